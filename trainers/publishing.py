"""A candidate that passed the gate, made a drafter version; and what the replicas decided about versions, kept.

- `version_meta`: the version's metadata in the store (parent, step, records trained, committable offsets, the
  gate's figures);
- `write_version`: the candidate's weights into the model store (`dvi.store`); a store that cannot take them (full,
  unwritable) leaves nothing half-written, and nothing is announced;
- `announce`: the version registered in MLflow (alias `candidate`, its lineage and gate figures as tags) through the
  tracker the trainer is handed, and announced as a `dvi.control.DrafterPublished` through its publisher; a control
  topic that cannot take it leaves the version in the store and the registry;
- `record_verdict`: a replica's verdict on one of the store's versions (`store.REJECTED`, `store.PRODUCTION`),
  written into the store, where a restarting replica reads it.

This module knows the store, the registration's tags and the control message. It does not know the gate, the
trainer's loop or its ranks (the trainer calls it on rank 0), nor Kafka or MLflow clients: the tracker and the
publisher are passed in.
"""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors import SafetensorError

from dvi import __version__, store
from dvi.control import DrafterPromoted, DrafterPublished, DrafterRejected
from dvi.errors import DviError
from trainers.state import State

log = logging.getLogger("dvi.trainer")


def version_meta(state: State, offsets: dict, gate: dict) -> dict:
    """The metadata of the version published from `state` (its parent: the drafter serving now)."""
    return {"parent": state.lineage[-1], "step": state.step, "records_trained": state.counters.trained,
            "offsets": {f"{t}:{p}": o for (t, p), o in offsets.items()}, "gate": gate}


def write_version(root: Path, version: str, weights: dict, parent_dir: Path, meta: dict, vocab_map) -> store.Published | None:
    """Drafter `version` written into the store `root`; None when the store could not take it (logged)."""
    try:
        return store.publish(root, version, weights, parent_dir, meta, vocab_map)
    except (OSError, SafetensorError) as e:  # full or unwritable: nothing half-written is left, nothing announced
        log.error("could not write drafter %s into the store %s (%s); not published", version, root, e)
        return None


def announce(published: store.Published, meta: dict, state: State, gate: dict, tracker, publisher) -> None:
    """Register `published` with the tracker (alias candidate) and announce it through the publisher (either may be
    None)."""
    parent = meta["parent"]
    tags = {"parent_version": parent, "records_trained": str(state.counters.trained), "step": str(state.step),
            "dvi.release": __version__, "records_held_out": str(state.counters.held_out),
            "offsets": ",".join(f"{k}={v}" for k, v in meta["offsets"].items()), "sha256": published.sha256,
            **{f"gate.{k}": f"{v:.6g}" for k, v in gate.items()}}
    if tracker is not None:
        tracker.register_drafter(str(published.path), published.version, tags, alias="candidate")
    if publisher is not None:
        try:
            publisher(DrafterPublished(version=published.version, uri=str(published.path),
                                       sha256=published.sha256, parent=parent, gate=gate))
        except DviError as e:  # the version is in the store and the registry; servers can still be pointed at it
            log.warning("published %s but could not announce it on the control topic: %s", published.version, e)


def record_verdict(root: Path, msg: DrafterRejected | DrafterPromoted, verdict: str) -> None:
    """Record what a replica decided about one of the versions of the store `root` (a restarting replica reads it);
    a version the store does not hold is left alone."""
    version = msg.version
    if not (root / version / store.SUMS).is_file():
        return
    reason = msg.reason if isinstance(msg, DrafterRejected) else None
    try:
        store.record_verdict(root, version, verdict, replica_id=msg.replica_id, reason=reason)
    except (OSError, DviError) as e:
        log.warning("could not record the verdict %s on %s in the store %s: %s", verdict, version, root, e)
