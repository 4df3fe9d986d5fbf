"""The bootstrap's held-out slice, kept beside live traffic: what adapting a drafter costs on what it started with.

A bootstrap drafter (`trainers.bootstrap`) is made from a corpus split by source, so its held-out answers come from
sources no training record came from. A slice of them, the anchor, ships beside it: a few answers a domain (`pick`),
each the first record of a greedy answer as serving would log it, in a gzipped JSON-lines file of DecisionRecords
(`write`, `read`; `slice_path` names it beside the drafter). `trainer.anchor` picks it (`resolve`: auto is the shipped
drafter's slice when the trainer starts from the shipped drafter).

The trainer keeps it beside the held-out records of live traffic (`Anchor`):
- when a gate first needs it, its examples get the target's features once (`with_features`), where the drafter reads
  them, and the drafter the run started from is evaluated on it: the start figure;
- a candidate that passes the gate on live traffic is evaluated on it too, per domain and in all, and refused when its
  acceptance there is more than `trainer.anchor_max_drop` below the start figure (`holds`), whatever it gains on live
  traffic; the figures go into the gate's metrics and into the published version's tags (MLflow), so every version
  says what adapting cost on the bootstrap's domains.

This module knows records, examples and the target's features; it does not know the trainer's loop, the gate's
ranking or where versions go.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import replace
from pathlib import Path

import torch

from dvi import drafters
from dvi.config import DviConfig
from dvi.eagle3 import target_features
from dvi.errors import DviError
from dvi.features import Features
from dvi.files import sha256_file
from dvi.records import DecisionRecord, from_dict
from trainers.data import Example
from trainers.gate import group_by_domain

SUFFIX = ".heldout.jsonl.gz"  # the slice's file, beside the drafter's directory
PER_DOMAIN = 12  # answers a domain in a slice


def slice_path(drafter_dir: Path) -> Path:
    """The slice file beside a bootstrap drafter's directory (the directory itself holds a store version's files only)."""
    drafter_dir = Path(drafter_dir)
    return drafter_dir.with_name(drafter_dir.name + SUFFIX)


def resolve(cfg: DviConfig) -> Path | None:
    """The slice `trainer.anchor` names: none, a file, or auto (the shipped drafter's, when the trainer starts from it)."""
    name = cfg.trainer.anchor
    if name == "none":
        return None
    if name == "auto":
        return slice_path(drafters.SHIPPED) if drafters.applies(cfg.model) else None
    path = Path(name).expanduser()
    if not path.is_file():
        raise DviError(f"trainer.anchor: {str(path)!r} is not a file (a bootstrap drafter's held-out slice, "
                       f"<drafter>{SUFFIX}; auto or none)")
    return path


def draw(by_domain: dict[str, list], per_domain: int, seed: int) -> list:
    """Per domain, in the order of `by_domain`, `per_domain` of its items drawn at random (seeded with `seed` and the
    domain: the same draw every time)."""
    out = []
    for domain, items in by_domain.items():
        out += random.Random(f"{seed}:{domain}").sample(items, min(per_domain, len(items)))
    return out


def pick(records: list[DecisionRecord], per_domain: int = PER_DOMAIN, seed: int = 0) -> list[DecisionRecord]:
    """The slice of `records` (a bootstrap's held-out records): per domain, in domain order, the first records of
    `per_domain` answers drawn at random (`draw`), greedy answers only (temperature 0)."""
    first = [r for r in records if r.chunk_index == 0 and r.sampling.temperature == 0.0]
    domains = sorted({r.domain or "" for r in first})
    return draw({d: sorted((r for r in first if (r.domain or "") == d), key=lambda r: r.record_id) for d in domains},
                per_domain, seed)


def write(records: list[DecisionRecord], path: Path) -> dict:
    """`records` as gzipped JSON lines at `path` (written beside, renamed over); their count and the file's sha256."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile("", "wb", fileobj=raw, mtime=0) as f:  # no name, no time: the same
        for r in records:                                                          # records make the same bytes
            f.write((json.dumps(r.to_dict()) + "\n").encode())
    tmp.replace(path)
    return {"records": len(records), "sha256": sha256_file(path)}


def read(path: Path, vocab_size: int | None = None) -> list[DecisionRecord]:
    """The records of a slice file, validated (`dvi.records.from_dict`); a DviError names the file and line of the
    first that does not read."""
    out = []
    try:
        with gzip.open(path, "rt") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(from_dict(json.loads(line), vocab_size))
                except (ValueError, RecursionError) as e:  # RecordError and JSONDecodeError are ValueErrors
                    raise DviError(f"{path}:{n}: not a record of the held-out slice: {e}") from None
    except (OSError, EOFError) as e:  # not gzip, cut short, unreadable
        raise DviError(f"{path}: the held-out slice does not read: {e}") from None
    if not out:
        raise DviError(f"{path}: the held-out slice holds no record")
    return out


def with_features(examples: list[Example], target: torch.nn.Module, layer_ids) -> list[Example]:
    """`examples` carrying the target's features of their tokens (rows for every token but the last, bf16 as serving
    sends them), computed one example at a time."""
    device = next(target.parameters()).device
    out = []
    with torch.no_grad():
        for e in examples:
            ids = torch.as_tensor(e.tokens[:-1], device=device).unsqueeze(0)
            rows = target_features(target, ids, layer_ids)[0].float().cpu()
            out.append(replace(e, features=Features.encode(rows, layer_ids, 0)))
    return out


def holds(candidate: float, start: float, max_drop: float) -> bool:
    """Whether a candidate's acceptance on the slice is at most `max_drop` below the start figure."""
    return candidate >= start - max_drop


def gate_figures(figures: dict[str, dict], start: dict[str, dict]) -> dict[str, float]:
    """The gate's figures of a candidate on the slice (`figures`, pooled per domain and "all"): its realized and
    expected acceptance in all, the start figure, and its realized acceptance per domain."""
    out = {"anchor_acceptance": figures["all"]["realized"], "anchor_expected": figures["all"]["acceptance"],
           "anchor_start": start["all"]["realized"]}
    out.update((f"anchor_{d}", f["realized"]) for d, f in sorted(figures.items()) if d != "all")
    return out


class Anchor:
    """The slice as the trainer keeps it: its examples (with features where the drafter reads them, once the trainer
    has computed them), each example's domain, where it came from, and the start figures (`start`, set by the trainer
    with the features; empty until then)."""

    def __init__(self, path: Path, examples: list[Example], domains: list[str]):
        self.path, self.examples, self.domains = Path(path), examples, domains
        self.start: dict[str, dict] = {}

    @property
    def positions(self) -> int:
        return sum(e.positions for e in self.examples)

    def by_domain(self, each) -> dict[str, list]:
        """Per-example figures (`trainers.gate.evaluate_each`, in the examples' order) grouped by domain, and "all"."""
        each = list(each)
        return {"all": each, **group_by_domain(self.domains, each)}  # a record without a domain counts in all only
