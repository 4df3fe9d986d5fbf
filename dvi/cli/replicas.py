"""One builder for a serving replica's channels, used by `dvi serve` (serve.engine=dvi) and by dvi's
plugin inside vLLM's own server: the decision producer, the control channel for hot swaps and the MLflow tracker, from
the config, for `dvi.serving.replica.Replica`, which is handed them and knows none of their construction.
"""

from __future__ import annotations

from dvi.config import DviConfig, flat_params
from dvi.tracking import Tracker
from streams.control import ControlChannel
from streams.producer import DecisionProducer


def replica_channels(cfg: DviConfig, *, swaps: bool = True, tags: dict[str, str] | None = None) -> dict:
    """`Replica`'s producer, control and tracker for the replica `cfg.stream.replica_id`: its records to the decision
    stream where `serve.log_decisions`, announcements from the control topic where `serve.swap.enabled` and `swaps`
    (an engine that can take a drafter), its metrics to MLflow where `tracking.enabled` (run `serve-<replica id>`, tagged
    with its role, its id and `tags`); None for each one off."""
    replica_id = cfg.stream.replica_id
    tracker = None
    if cfg.tracking.enabled:
        tracker = Tracker(cfg.tracking, run_name=f"serve-{replica_id}", params=flat_params(cfg),
                          tags={"dvi.role": "serve", "dvi.replica": replica_id, **(tags or {})})
    return {"producer": DecisionProducer(cfg.stream) if cfg.serve.log_decisions else None,
            "control": ControlChannel(cfg.stream, client_id=f"dvi-serve-{replica_id}") if cfg.serve.swap.enabled and swaps else None,
            "tracker": tracker}
