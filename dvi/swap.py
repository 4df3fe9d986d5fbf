"""Hot-swap: turning a `drafter_published` announcement into a drafter that is safe to serve, and judging it live.

`load_announced(published, ...)`, given a `dvi.control.DrafterPublished`, is the only way a running server gets new
drafter weights. Each file is read once (`dvi.store.read_verified`), and the drafter is built from exactly the bytes
that were hashed. In order, it refuses (raising `Refused` with a reason code and a message saying what and where):

- `bad_message`: the version name is not a plain name (a message without a version, a uri or a sha256 never
  gets here: `dvi.control.decode` refuses it);
- `outside_store`: the uri does not resolve to `<store root>/<version>` (symlinks and `..` resolved first);
- `pickle`: the directory holds a pickle-capable weight file (nothing here ever unpickles);
- `files`: an entry is not a regular file (a link, a folder), has a name a version does not hold, or the files
  hold more bytes than the target's weights (`max_drafter_bytes`);
- `checksum`: SHA256SUMS does not match the announced sha256, or a file does not match SHA256SUMS;
- `config`: config.json differs from the configured drafter's (or, with none, the target's) in more than the
  drafter's own fields (its layers), has more layers than the target, names code to run (`auto_map`), or sets a
  private key (`_attn_implementation` and the like pick kernels, possibly from the hub; only `_PRIVATE_METADATA`);
  an EAGLE-3 version's (speculators format, `dvi.eagle3`): its layer config is not the target's shapes in one layer,
  its verifier's architecture or hidden size is not the target's, or its aux layers or draft vocabulary do not fit
  the target (`auto_map` and private keys are refused in its layer config too);
- `shapes`: a weight in model.safetensors has another shape than the drafter's config implies, or one is missing;
- `load`: the weights or the reduced head do not load as a drafter of this target (vocabulary, repeated ids);
- `nonfinite`: a weight holds NaN or inf;
- `smoke`: a short greedy decode with the new drafter fails or produces non-finite logits.

The checks that differ by kind of drafter (its config, its tensors, how it loads and its smoke run) are its
`dvi.drafter_kinds.DrafterKind`'s: a layer drafter's are above; an EAGLE-3 version's (`Eagle3Kind`) load it as a
`dvi.eagle3.Eagle3Drafter` (d2t and t2d checked: `load`, its smoke run one forward), which vLLM serves with method
eagle3 (a server started with an EAGLE-3 drafter, `dvi.cli.vllm.engine`). Each kind loads only where that kind
serves: `load_announced(..., kind=...)` refuses a version of another kind than the one it is asked for (`load`).

It runs on the caller's thread (the server's swap thread), never on the decoding thread; the engine's
`swap_drafter` then switches the pointer between verification rounds.

`judge(...)` is the live check after a swap, a pure function of drafting rounds: wait for `window_tokens`
drafted tokens of the new drafter, then keep it unless its acceptance is more than `rollback_margin` below
the previous drafter's on the traffic just before the swap (its latest `window_tokens` drafted tokens, not its
lifetime figure, which drifted traffic would inflate; with fewer than `baseline_tokens`, there is nothing to
compare against and the new drafter is kept). Both on their first drafts (`compare`): every round drafts one, at
whatever K the planner chose. Accepted over drafted tokens would hold the deeper-drafted drafter to a lower figure
whatever it is worth (acceptance per drafted token falls with K, and a new drafter's first rounds draft
`serve.spec.k`); and at a deeper depth only the rounds drafted that deep count, which the planner drafts where the
recent traffic accepts well: the replaced drafter's came from its easy stretches, the new one's trial from whatever
traffic came. Compared at the depth both drafted to in half their rounds (4), a `dvi up` run rolled back five of six
published drafters that offline drafted as well as the one they replaced (within 0.02 drafts accepted a round at K=4,
or better: benchmarks.depth_by_version).

This module knows the model store and the kinds of drafter (`dvi.drafter_kinds`); not Kafka, HTTP or MLflow.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from dvi import store
from dvi.control import DrafterPublished
from dvi.drafter_kinds import Checked, DrafterKind, kind_of, kind_of_config
from dvi.errors import DviError, Refused
from dvi.models import LAYERS

log = logging.getLogger("dvi.swap")

_PRIVATE_METADATA = frozenset({"_name_or_path", "_model_name_or_path", "_commit_hash"})  # the private keys a version may set
TOKENIZER_ROOM = 64 << 20  # bytes of config and tokenizer files a version may hold beside its weights


def resolve_in_store(uri: str, version: str, store_root: Path) -> Path:
    """The version's directory, which must be exactly <store_root>/<version> once resolved."""
    root = Path(store_root).expanduser().resolve()
    path = Path(uri.removeprefix("file://")).expanduser().resolve()
    if path != root / version:
        raise Refused("outside_store", f"drafter {version}: {uri} is not {root / version}; drafters load only from the store {root}")
    return path


def check_announced(ann: DrafterPublished, store_root: Path, target: torch.nn.Module, family=None) -> Checked:
    """The checks of the module docstring up to `shapes`, for a version of any kind (`dvi.drafter_kinds`): its files
    read once and verified, its config and its weights, or Refused. `family`: see `load_announced` (layer drafters)."""
    try:
        store.check_version_name(ann.version)
    except DviError as e:
        raise Refused("bad_message", str(e)) from None
    path = resolve_in_store(ann.uri, ann.version, store_root)
    if not path.is_dir():
        raise Refused("load", f"drafter {ann.version}: {path} does not exist (a store not shared with the trainer?)")
    try:
        files = store.read_verified(path, ann.sha256, max_bytes=max_drafter_bytes(target))
    except store.VersionError as e:
        raise Refused(e.kind, f"drafter {ann.version}: {e}") from None
    kind, raw = _kind_of(files, ann.version)
    config, fields = kind.check_config(raw, family if family is not None else target.config, target.config, ann.version)
    weights, head = kind.read_tensors(files, config, fields, ann.version)
    return Checked(kind, path, config, fields, weights, head)


def load_announced(ann: DrafterPublished, store_root: Path, target: torch.nn.Module, smoke_tokens: int = 8,
                   dtype: torch.dtype = torch.float32, family=None, device: torch.device | None = None,
                   kind: DrafterKind | str = LAYERS):
    """Check and load an announced drafter of `kind` (see the module docstring), as that kind serves it
    (`DrafterKind.load_version`: a layer drafter in `dtype` on `device`, None: the target's; an EAGLE-3 one in
    `dtype` on the CPU), or raise Refused. `family`: the config every layer version must match but for the drafter's
    own fields: the configured drafter's (the trainer publishes versions of it), or by default the target's (a drafter
    built from the target). `target` may hold no weights (the meta device): only its config, parameter count and (an
    EAGLE-3 version's shared) embedding are read."""
    serves = kind_of(kind) if isinstance(kind, str) else kind
    checked = check_announced(ann, store_root, target, family)
    if checked.kind is not serves:
        raise serves.refuse_other(ann.version, checked.kind)
    return serves.load_version(checked, ann.version, target, dtype, device, smoke_tokens)


def max_drafter_bytes(target: torch.nn.Module) -> int:
    """The most a version's files may hold: the target's weights in fp32, plus room for its tokenizer files."""
    return sum(p.numel() for p in target.parameters()) * 4 + TOKENIZER_ROOM


def _kind_of(files: dict[str, bytes], version: str) -> tuple[DrafterKind, dict]:
    """(kind, parsed config.json) of a version: the config must be some kind's (`dvi.drafter_kinds.kind_of_config`),
    name no code to run (`auto_map`) and set no private key but metadata, in its nested layer config too; else
    Refused("config"). (The private keys of the loaded config and the one it is compared with are not compared:
    transformers sets its own.)"""
    try:
        raw = json.loads(files["config.json"])
        kind = kind_of_config(raw) if isinstance(raw, dict) else None
        if kind is None:
            raise ValueError("not a JSON object with a model_type")
    except (KeyError, ValueError) as e:
        raise Refused("config", f"drafter {version}: no readable config.json ({e})") from None
    nested = raw.get("transformer_layer_config")
    for part in (raw, nested) if isinstance(nested, dict) else (raw,):
        if "auto_map" in part:
            raise Refused("config", f"drafter {version}: its config names code to run (auto_map); drafters are plain models")
        private = sorted(k for k in part if k.startswith("_") and k not in _PRIVATE_METADATA)
        if private:  # they steer how transformers builds the model (attention kernels, hub code), not what the model is
            raise Refused("config", f"drafter {version}: its config sets private keys {private[:5]}; a version may set only "
                                    f"{sorted(_PRIVATE_METADATA)} of them")
    return kind, raw


Rounds = list[tuple[int, int]]  # drafting rounds, (drafted, accepted) each


def at_depth(rounds: Rounds, depth: int) -> tuple[int, int]:
    """(drafted, accepted) of `rounds` cut at `depth`: the first `depth` tokens of every round that drafted at least
    that many (a round accepts a prefix of its drafts, so min(accepted, depth) of them)."""
    deep = [a for k, a in rounds if k >= depth]
    return depth * len(deep), sum(min(a, depth) for a in deep)


def compare(previous: Rounds, current: Rounds) -> tuple[float, float]:
    """(previous acceptance, current acceptance): each side's accepted over drafted first drafts (`at_depth` 1: every
    round, whatever its K; see the module docstring)."""
    (d0, a0), (d1, a1) = at_depth(previous, 1), at_depth(current, 1)
    return a0 / d0 if d0 else 0.0, a1 / d1 if d1 else 0.0


def judge(previous: Rounds | None, current: Rounds, window_tokens: int, baseline_tokens: int,
          margin: float) -> str | None:
    """Keep or roll back a swapped-in drafter, from its drafting rounds since the swap and the replaced one's
    latest: "keep", "rollback", or None (not enough of the new drafter's traffic yet). `previous`: None when there
    was no drafter. The two are compared on their first drafts (`compare`). A trial that accepted nothing is rolled back
    whatever came before: a drafter live traffic never accepts is no drafter to promote."""
    if sum(k for k, _ in current) < window_tokens:
        return None
    if sum(a for _, a in current) == 0:
        return "rollback"
    if previous is None or sum(k for k, _ in previous) < baseline_tokens:
        return "keep"
    before, now = compare(previous, current)
    return "rollback" if now < before - margin else "keep"
