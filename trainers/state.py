"""The trainer's own state besides the weights: what it counts (`Counters`) and what a checkpoint carries (`State`,
whose lineage also tells how many publishes ago a drafter version served: `State.version_age`).

Every rank counts the records it reads itself. A checkpoint holds, besides the step, the lineage and the serving
drafter's directory, the counters summed over the ranks and each rank's own (`ranks`), the union of the ranks'
record-id ledgers and the offsets every rank may commit (`merged`, from each rank's `rank_part`). On resuming, each
rank takes back its own counters (`restore`) and the shared ledger: partitions may be assigned to another rank after a
restart.

This module knows that layout, a checkpoint's JSON state; writing it to disk is `trainers.checkpoint`'s, and what
the trainer counts and when it checkpoints is `trainers.recipe`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainers.data import Ledger


@dataclass
class Counters:
    records: int = 0  # records for this target received (not duplicates, not foreign)
    duplicates: int = 0  # records whose id was already in the ledger
    foreign: int = 0  # records for another target vocabulary or without generated tokens
    trained: int = 0
    held_out: int = 0
    skipped: int = 0  # fresh records dropped without training: from a full queue, or expired
    expired: int = 0  # of those, the records that waited longer than trainer.pending_max_age_s
    nonfinite: int = 0  # batches skipped for a non-finite loss
    published: int = 0
    refused: int = 0  # gate checks the candidate lost
    checkpoint_failures: int = 0  # checkpoints that could not be written (disk full, I/O error): the previous one stands
    positions: int = 0  # teacher positions trained on (fresh and replayed)
    gates: int = 0  # gate checks run (passed or refused)
    retrains: int = 0  # retrain requests acknowledged
    no_features: int = 0  # records skipped (and counted in skipped): an EAGLE-3 drafter's features neither carried nor computable
    no_teacher: int = 0  # records skipped (and counted in skipped): no top-k logged and no copy of the target
    with_features: int = 0  # records whose features (serving's) the trainer took

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class State:
    """What a checkpoint holds besides the weights and optimizer state."""

    step: int = 0
    lineage: list[str] = field(default_factory=list)  # drafter versions served, oldest first; [-1] serves now
    serving_dir: str = ""  # the serving drafter's directory (the parent of the next publish)
    counters: Counters = field(default_factory=Counters)

    def version_age(self, version: str | None) -> int | None:
        """Publishes between `version` and the serving drafter (0: serving); None for a version not in the lineage.
        A record no drafter drafted for (version None: drafting was off, or the engine served target-only) carries
        the target's choices alone, as current for any drafter as the newest record: age 0."""
        if version is None:
            return 0
        lineage = self.lineage
        return len(lineage) - 1 - lineage.index(version) if version in lineage else None


def rank_part(counters: Counters, ledger: Ledger, committable: dict) -> dict:
    """One rank's part of a checkpoint: its counters, its ledger and the offsets it may commit."""
    return {"counters": counters.to_dict(), "ledger": ledger.entries(),
            "offsets": {f"{topic}:{part}": off for (topic, part), off in committable.items()}}


def merged(state: State, ranks: list[dict]) -> dict:
    """A checkpoint's JSON state: `state`'s step, lineage and serving drafter, with every rank's `rank_part`."""
    return {"step": state.step, "lineage": state.lineage, "serving_dir": state.serving_dir, "counters": _summed(ranks),
            "ledger": _merged_ledgers(ranks), "offsets": {k: v for r in ranks for k, v in r["offsets"].items()},
            "ranks": [r["counters"] for r in ranks]}


def restore(state: State, saved: dict, rank: int) -> None:
    """`state` as checkpoint state `saved` left it, with rank `rank`'s own counters (they sum to the checkpoint's
    totals; a rank the checkpoint did not have starts from zero)."""
    state.step = int(saved["step"])
    state.lineage = list(saved["lineage"])
    state.serving_dir = saved["serving_dir"]
    ranks = saved.get("ranks") or [saved["counters"]]
    state.counters = Counters(**ranks[rank]) if rank < len(ranks) else Counters()


def _summed(ranks: list[dict]) -> dict:
    """Counters of all ranks added up."""
    return {k: sum(r["counters"][k] for r in ranks) for k in ranks[0]["counters"]}


def _merged_ledgers(ranks: list[dict]) -> list[list[str]]:
    """The union of the ranks' ledgers (each holds the restored shared part, then its own records)."""
    union: dict[str, str] = {}
    for r in ranks:
        for rid, fate in r["ledger"]:
            union.setdefault(rid, fate)
    return [[rid, fate] for rid, fate in union.items()]
