"""From DecisionRecords to training batches: examples, the replay buffer, the ledger and committable offsets.

One record becomes one `Example`: its full token sequence (prompt + earlier chunks + this chunk's tokens) and,
for every token the record generated, the decision made at the position that predicted it. A round with k
drafts and n accepted emits n + 1 tokens, and the teacher (the target's top-k) was logged at each of the
positions j = 0..n that produced them, so every generated token has exactly one teacher distribution, on the
sequence itself: one causal forward of the drafter over the sequence sees all of them. Per generated token:

- teacher: top-k ids and log-probs at the position that predicted it (absent when the record has topk = 0:
  the trainer recomputes the teacher with its copy of the target on the same sequence);
- draft: the drafter's proposal at that position (d_{j+1} for j < k; -1 at the bonus position j = k and in
  plain rounds) and its reward for the DVI term: +1 accepted (j < n), -1 rejected (j = n < k), 0 not judged.

Positions after a round's first rejection (j > n) lie off the sequence (their context holds a rejected draft);
they were never judged, and the one-forward layout leaves them out.

A record that carries the target's features (`dvi.features`: what an EAGLE-3 drafter reads, from serving's forwards)
keeps them beside its tokens, still encoded, one row per token of the example's window but the last (which no forward
fed); where they start later than the window would, the window starts there. Examples are batched only with examples
of the same teacher width and with features or not alike (`batch_key`).

The `Buffer` holds fresh records waiting to be trained (oldest skipped, and counted, when full, in count or in bytes),
records held out for the gate, and already-trained records for replay (weighted down by drafter-version age); held-out
and replayed ones are bounded in count and in bytes (`Kept`). Records are held out by prompt: every record of a prompt
(its chunks, its other samples, the same question asked again) goes the same way, so the gate never scores a drafter
on a prompt it trained on. The `Ledger`
remembers the `Fate` of every record id (trained, held out, skipped) for deduplication and for the
exactly-once check after a restart; `Offsets` tracks which consumed offsets are done, so a checkpoint commits
only offsets whose records it covers. `Ahead` builds the next batch on a worker thread into pinned memory while
the device trains on the last one (CUDA), and moves batches to the device. `FileSource` reads a JSON-lines file
of records (`dvi stream tail --json`) behind the same poll interface as the stream's consumer, returning
`dvi.records.Delivered`.

This module knows records, tensors and files; not models, Kafka (the stream's consumer is `streams.consumer`'s)
or DeepSpeed. Records arrive validated: the codec (`dvi.record_codec.decode` / `dvi.records.from_dict`) checks them at the wire.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from enum import Enum
from pathlib import Path

import numpy as np
import torch

from dvi.errors import DviError
from dvi.features import Features
from dvi.records import DecisionRecord, Delivered, from_dict

log = logging.getLogger("dvi.trainer")


class Fate(str, Enum):
    """What became of a record, as the ledger (and a checkpoint on disk) stores it."""

    TRAINED = "t"
    HELD_OUT = "h"  # kept for the gate
    SKIPPED = "s"  # dropped from a full queue, or its batch had a non-finite loss


@dataclass(frozen=True)
class Example:
    """One record as training data. G = generated tokens kept (after truncation), S = sequence length."""

    record_id: str
    version: str | None  # the drafter that drafted its rounds
    tokens: np.ndarray  # [S] int64: context + generated tokens
    targets: np.ndarray  # [G] int64 indices into tokens of the generated tokens (each >= 1)
    topk_ids: np.ndarray | None  # [G, topk] int64 teacher ids at the position predicting each target
    topk_logprobs: np.ndarray | None  # [G, topk] float32
    drafted: np.ndarray  # [G] int64 the draft proposed at that position, -1 for none
    reward: np.ndarray  # [G] float32 +1 accepted, -penalty rejected, 0 not judged
    judged: np.ndarray  # [G] bool the draft there was accepted or rejected
    accepted: int  # the record's totals, for rolling acceptance
    drafted_total: int
    features: Features | None = None  # rows for tokens[0 .. S - 2] (the target's, encoded), or None
    temperature: float = 0.0  # the request's sampling (what the engine's acceptance of a draft depends on)
    top_p: float = 1.0
    prompt_key: int = 0  # a hash of the request's prompt: records of one prompt are held out together
    domain: str | None = None  # the request's domain tag (the gate judges each domain's held-out records too)

    @property
    def positions(self) -> int:
        return int(self.targets.shape[0])

    @property
    def nbytes(self) -> int:
        """The memory its arrays hold."""
        arrays = (self.tokens, self.targets, self.topk_ids, self.topk_logprobs, self.drafted, self.reward, self.judged)
        return sum(a.nbytes for a in arrays if a is not None) + (0 if self.features is None else self.features.nbytes)


def prompt_key(prompt_ids) -> int:
    """A 64-bit hash of a prompt's token ids."""
    return int.from_bytes(hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=8).digest(), "big")


def example_from_record(record: DecisionRecord, max_seq_len: int, penalty: float = 1.0, features: bool = True) -> Example:
    """The `Example` of one validated record; sequences longer than `max_seq_len` keep their last tokens (and those
    from the first position its features cover, where it carries them: `features` False drops them)."""
    context = list(record.prompt_ids) + list(record.prefix_ids)
    tokens = np.asarray(context + list(record.generated_ids), dtype=np.int64)
    topk = record.topk
    g_total = len(record.generated_ids)
    topk_ids = np.zeros((g_total, topk), np.int64) if topk else None
    topk_lp = np.zeros((g_total, topk), np.float32) if topk else None
    drafted = np.full(g_total, -1, np.int64)
    reward = np.zeros(g_total, np.float32)
    judged = np.zeros(g_total, bool)
    base = len(record.prefix_ids)  # round positions count tokens generated for the request so far
    for r in record.rounds:
        for j in range(r.accepted + 1):
            g = r.position - base + j
            if g >= g_total:  # the request's last round, cut short by a stop token or the length limit
                break
            if topk:
                topk_ids[g] = r.topk_ids[j]
                topk_lp[g] = r.topk_logprobs[j]
            if j < r.k:
                drafted[g] = r.drafted[j]
                judged[g] = True
                reward[g] = 1.0 if j < r.accepted else -penalty
    targets = np.arange(len(context), len(tokens), dtype=np.int64)
    shift = max(0, len(tokens) - max_seq_len)
    rows = record.features if features else None
    if rows is not None:
        shift = max(shift, rows.start)
        rows = rows.window(shift, len(tokens) - 1)  # the last token's row is never read
        if rows is None or rows.start != shift:  # no row where the window starts: nothing to draft from
            rows = None
    keep = targets >= shift + 1  # a target needs its predicting position inside the window
    return Example(
        record_id=record.record_id,
        version=record.drafter_version,
        tokens=tokens[shift:],
        targets=targets[keep] - shift,
        topk_ids=topk_ids[keep] if topk else None,
        topk_logprobs=topk_lp[keep] if topk else None,
        drafted=drafted[keep],
        reward=reward[keep],
        judged=judged[keep],
        accepted=record.accepted,
        drafted_total=record.drafted,
        features=rows,
        temperature=float(record.sampling.temperature),
        top_p=float(record.sampling.top_p),
        prompt_key=prompt_key(record.prompt_ids),
        domain=record.domain,
    )


def teacher_width(example: Example) -> int:
    return 0 if example.topk_ids is None else int(example.topk_ids.shape[1])


def batch_key(example: Example) -> tuple[int, int | None]:
    """What examples batched together share: the teacher's width, and the width of their features (None: none)."""
    return teacher_width(example), None if example.features is None else example.features.width


@dataclass
class Batch:
    """Examples packed for one forward. B rows, L = longest sequence, P = teacher positions in all rows."""

    record_ids: list[str]
    input_ids: torch.Tensor  # [B, L] int64, right-padded with 0
    attention_mask: torch.Tensor  # [B, L] int64
    rows: torch.Tensor  # [P] int64 row of each position
    cols: torch.Tensor  # [P] int64 column whose logits predict the target (target index - 1)
    labels: torch.Tensor  # [P] int64 the generated token there
    topk_ids: torch.Tensor | None  # [P, topk] int64 (None: no example carries a teacher)
    topk_logprobs: torch.Tensor | None  # [P, topk] float32
    drafted: torch.Tensor  # [P] int64 (-1: none)
    reward: torch.Tensor  # [P] float32
    judged: torch.Tensor  # [P] bool
    weight: torch.Tensor  # [P] float32 per-position weight (the record's replay weight)
    temperature: torch.Tensor | None = None  # [P] float32 the request's sampling temperature (0: greedy)
    top_p: torch.Tensor | None = None  # [P] float32
    features: torch.Tensor | None = None  # [B, L, W] bfloat16 the target's features of each token (0 past a row's end)

    @property
    def positions(self) -> int:
        return int(self.rows.numel())

    def _map(self, fn) -> Batch:
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    def pinned(self) -> Batch:
        """The batch in page-locked host memory, so copies to a GPU run asynchronously."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> Batch:
        """The batch on `device` (itself where it already is); copies from pinned memory do not block the host."""
        if self.input_ids.device == device:
            return self
        return self._map(lambda t: t.to(device, non_blocking=True))


def collate(examples: list[Example], weights: list[float] | None = None) -> Batch:
    """Pack examples (all with the same `batch_key`: teacher width, features or not) into a `Batch`."""
    if not examples:
        raise ValueError("collate: no examples")
    weights = weights or [1.0] * len(examples)
    keys = {batch_key(e) for e in examples}
    if len(keys) != 1:
        raise ValueError(f"collate: examples mix teacher widths and features {sorted(keys, key=str)}; batch them separately")
    width, feature_width = keys.pop()
    length = max(len(e.tokens) for e in examples)
    features = None
    if feature_width is not None:
        features = torch.zeros(len(examples), length, feature_width, dtype=torch.bfloat16)
        for b, e in enumerate(examples):
            features[b, : e.features.rows] = e.features.tensor()
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    mask = torch.zeros(len(examples), length, dtype=torch.long)
    for b, e in enumerate(examples):
        ids[b, : len(e.tokens)] = torch.from_numpy(e.tokens)
        mask[b, : len(e.tokens)] = 1
    cat = lambda xs: torch.from_numpy(np.concatenate(xs))  # noqa: E731
    rows = torch.cat([torch.full((e.positions,), b, dtype=torch.long) for b, e in enumerate(examples)])
    cols = cat([e.targets - 1 for e in examples])
    return Batch(
        record_ids=[e.record_id for e in examples],
        input_ids=ids,
        attention_mask=mask,
        rows=rows,
        cols=cols,
        labels=ids[rows, cols + 1],
        topk_ids=cat([e.topk_ids for e in examples]) if width else None,
        topk_logprobs=cat([e.topk_logprobs for e in examples]) if width else None,
        drafted=cat([e.drafted for e in examples]),
        reward=cat([e.reward for e in examples]),
        judged=cat([e.judged for e in examples]),
        weight=torch.cat([torch.full((e.positions,), float(w)) for e, w in zip(examples, weights)]),
        temperature=torch.cat([torch.full((e.positions,), e.temperature) for e in examples]),
        top_p=torch.cat([torch.full((e.positions,), e.top_p) for e in examples]),
        features=features,
    )


class Ahead:
    """Batches built one step ahead: `submit` collates examples on a worker thread (into pinned memory on the way to
    a GPU) and starts their copy to the device while the caller's step runs; `take` returns what was submitted with
    its batch on the device. `threaded`: None builds ahead on a CUDA device only; elsewhere nothing is built ahead
    and `build` collates in the calling thread. The payload travels with the batch untouched (the trainer's fresh
    items and weights)."""

    def __init__(self, device: torch.device, threaded: bool | None = None):
        self.device = device
        self.threaded = device.type == "cuda" if threaded is None else threaded
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dvi-batch") if self.threaded else None
        self._next: tuple[object, Future] | None = None

    def build(self, examples: list[Example], weights: list[float]) -> Batch:
        """`collate(examples, weights)` on the device (pinned on the way to a GPU)."""
        batch = collate(examples, weights)
        return (batch.pinned() if self.device.type == "cuda" else batch).to(self.device)

    def submit(self, payload, examples: list[Example], weights: list[float]) -> None:
        if self._pool is None or self._next is not None:
            raise RuntimeError("Ahead.submit: nothing is built ahead here, or a batch is already waiting")
        self._next = (payload, self._pool.submit(self.build, examples, weights))

    @property
    def waiting(self) -> bool:
        return self._next is not None

    def take(self) -> tuple[object, Batch] | None:
        """(payload, batch on the device) of the batch submitted last, or None; an error building it raises here."""
        if self._next is None:
            return None
        (payload, future), self._next = self._next, None
        return payload, future.result()

    def drop(self) -> None:
        """Forget the batch submitted last (after a rollback: its records are read again)."""
        if self._next is not None:
            self._next[1].cancel()
            self._next = None

    def close(self) -> None:
        self.drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------
# Bookkeeping: which record ids are done, and which offsets may be committed.


class Ledger:
    """Record id -> `Fate`, in arrival order, bounded to the newest `size` ids."""

    def __init__(self, size: int, entries: list[list[str]] | None = None):
        self.size = size
        self._fates: OrderedDict[str, Fate] = OrderedDict((rid, Fate(fate)) for rid, fate in entries or [])

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._fates

    def fate(self, record_id: str) -> Fate | None:
        return self._fates.get(record_id)

    def __len__(self) -> int:
        return len(self._fates)

    def add(self, record_id: str, fate: Fate) -> None:
        if record_id in self._fates:
            raise ValueError(f"record {record_id} is already in the ledger ({self._fates[record_id].name})")
        self._fates[record_id] = Fate(fate)
        while len(self._fates) > self.size:
            self._fates.popitem(last=False)

    def entries(self) -> list[list[str]]:
        """JSON-able form for the checkpoint: [record id, fate value ("t", "h", "s")]."""
        return [[rid, fate.value] for rid, fate in self._fates.items()]


class Offsets:
    """Per partition: offsets consumed but not yet done, and the next offset to read.

    `committable()` is what a checkpoint may commit: per partition, the lowest offset still outstanding, or
    the next offset when none is. Keys are any hashable partition name (a Kafka TopicPartition, a file name).
    """

    def __init__(self) -> None:
        self._open: dict = {}
        self._next: dict = {}

    def consumed(self, partition, offset: int) -> None:
        self._open.setdefault(partition, set()).add(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def seen(self, partition, offset: int) -> None:
        """An offset that needs no training (a duplicate, or a record the consumer dead-lettered)."""
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def done(self, partition, offset: int) -> None:
        self._open.get(partition, set()).discard(offset)

    def forget(self, partition) -> None:
        """The partition's log was lost and begun again (offsets restart at 0): drop what was known of it.

        Only a broker that keeps its log in memory does this, and then the old log is gone anyway; an old record
        still in the buffer that shares an offset with a new one may mark it done early."""
        self._open.pop(partition, None)
        self._next.pop(partition, None)

    def committable(self, positions: dict | None = None) -> dict:
        """positions: the reader's own next offsets (they also pass records it dead-lettered), or None."""
        nxt = dict(self._next)
        for p, n in (positions or {}).items():
            nxt[p] = max(nxt.get(p, 0), n)
        return {p: min(self._open[p]) if self._open.get(p) else n for p, n in nxt.items()}


# ----------------------------------------------------------------------------------------------
# The buffer.


def pending_age_limit(max_age_s: float | None, retention_hours: float | None) -> float | None:
    """Seconds a fresh record may wait in the queue: `trainer.pending_max_age_s`, or by default half of
    `stream.retention_hours` (the other half leaves room for the checkpoint that commits it); None: no limit."""
    if max_age_s is not None:
        return float(max_age_s)
    return None if retention_hours is None else float(retention_hours) * 3600.0 / 2


@dataclass
class Item:
    example: Example
    partition: object
    offset: int
    time: float = 0.0  # unix seconds when its record was logged (0: unknown, never expires)


class Kept:
    """Examples kept oldest first, at most `max_items` of them and `max_bytes` of their arrays: the oldest leave
    first (the newest always stays, however large)."""

    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: deque[Example] = deque()
        self.nbytes = 0

    def append(self, e: Example) -> None:
        self._items.append(e)
        self.nbytes += e.nbytes
        while len(self._items) > 1 and (len(self._items) > self.max_items or self.nbytes > self.max_bytes):
            self.nbytes -= self._items.popleft().nbytes

    def extend(self, examples) -> None:
        for e in examples:
            self.append(e)

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Example:
        return self._items[i]


class Buffer:
    """Fresh, held-out and replay records; see the module docstring.

    `version_age(version) -> int | None` says how many publishes ago a drafter version served (0: the serving
    one; None: unknown). Replay weight = version_decay ** age; records older than `max_version_age` (or of an
    unknown version) are not replayed.
    """

    def __init__(self, pending_size: int, replay_size: int, holdout_size: int, replay_share: float,
                 holdout_share: float, version_decay: float, max_version_age: int, seed: int = 0, holdout_first: int = 0,
                 replay_bytes: int = 1 << 62, holdout_bytes: int = 1 << 62, pending_bytes: int = 1 << 62):
        self.pending: deque[Item] = deque()
        self.pending_bytes = pending_bytes
        self._pending_nbytes = 0
        self.replay = Kept(replay_size, replay_bytes)
        self.holdout = Kept(holdout_size, holdout_bytes)
        self.pending_size = pending_size
        self.replay_share = replay_share
        self.holdout_share = holdout_share
        self.version_decay = version_decay
        self.max_version_age = max_version_age
        self.rng = random.Random(seed)
        self.holdout_first = holdout_first  # the first prompts of each domain are all held out, this many of them
        self._first_left: dict[str | None, int] = {}  # domain tag (None: untagged) -> first prompts still to hold out
        self.held_prompts: OrderedDict[int, None] = OrderedDict()  # prompts held out by holdout_first (newest last)
        self._routed = self._returns = 0  # records routed, and held out as records of a first prompt come back

    def held_out(self, example: Example) -> bool:
        """Whether a record is held out: its prompt hash falls in the held-out share, or its prompt was among the
        first (`holdout_first`) of its domain (its tag; untagged records are one domain), so every record of a prompt
        goes one way, and a domain that traffic drifts to has held-out records for the gate to judge it on
        (`trainers.gate.judge`) within its first prompts rather than after 1 / holdout_share of them. Records of a
        first prompt that comes back are held out while they number fewer than `holdout_first` or the held-out share
        of all records: traffic that repeats a few prompts (a demo, a test) would otherwise hold out everything and
        train on nothing; its held-out records then share prompts with trained ones, as so few prompts cannot avoid."""
        key = example.prompt_key
        if (key >> 11) / float(1 << 53) < self.holdout_share:
            return True
        if key in self.held_prompts:
            if self._returns >= max(self.holdout_first, self.holdout_share * self._routed):
                return False
            self._returns += 1
            return True
        left = self._first_left.get(example.domain, self.holdout_first)
        if left > 0 and self.holdout_share > 0:  # an early gate needs held-out records first, on every domain
            self._first_left[example.domain] = left - 1
            self.held_prompts[key] = None
            while len(self.held_prompts) > 1 << 16:
                self.held_prompts.popitem(last=False)
            return True
        return False

    def add(self, item: Item) -> tuple[Fate | None, list[Item]]:
        """Route a fresh record: held out for the gate, or queued for training.

        Returns (Fate.HELD_OUT or None, the oldest pending items skipped to make room: over `pending_size` records
        or `pending_bytes` of their arrays, the newest staying whatever its size).
        """
        self._routed += 1
        if self.held_out(item.example):
            self.holdout.append(item.example)
            return Fate.HELD_OUT, []
        self.pending.append(item)
        self._pending_nbytes += item.example.nbytes
        dropped = []
        while len(self.pending) > 1 and (len(self.pending) > self.pending_size or self._pending_nbytes > self.pending_bytes):
            dropped.append(self._pop())
        return None, dropped

    def _pop(self) -> Item:
        item = self.pending.popleft()
        self._pending_nbytes -= item.example.nbytes
        return item

    def expire(self, before: float) -> list[Item]:
        """Take the fresh items logged before unix time `before` out of the queue, in queue order. The whole queue
        is looked at: it is in arrival order, and a fetch from several partitions can put an old record behind a
        new one."""
        if not any(0 < item.time < before for item in self.pending):  # the usual turn: nothing to take, nothing built
            return []
        expired, kept = [], deque()
        for item in self.pending:
            (expired if 0 < item.time < before else kept).append(item)
        self.pending = kept
        self._pending_nbytes = sum(i.example.nbytes for i in kept)
        return expired

    def pending_positions(self) -> int:
        return sum(i.example.positions for i in self.pending)

    def pending_nbytes(self) -> int:
        """The memory the arrays of the fresh records waiting hold."""
        return self._pending_nbytes

    def clear_pending(self) -> None:
        self.pending.clear()
        self._pending_nbytes = 0

    def take(self, batch_tokens: int, version_age) -> tuple[list[Item], list[Example], list[float]]:
        """Fresh items (oldest first) filling (1 - replay_share) of `batch_tokens` positions, then replayed
        examples, replay_share of the batch: for fewer fresh positions (the stream paused), as many more as keep that
        share (the last one past it), never a batch of mostly replay (a few records replayed over and over); with none
        fresh, a whole batch of replay. All with the `batch_key` of the oldest fresh item (a batch never mixes teacher
        widths, or examples with and without features). Returns (fresh items, replayed examples, their replay weights)."""
        fresh, used, kept = [], 0, deque()
        budget = max(1, int(round(batch_tokens * (1.0 - self.replay_share))))
        key = batch_key(self.pending[0].example) if self.pending else (batch_key(self.replay[-1]) if self.replay else None)
        while self.pending and (not fresh or used + self.pending[0].example.positions <= budget):
            item = self._pop()
            if batch_key(item.example) != key:
                kept.append(item)
                continue
            fresh.append(item)
            used += item.example.positions
        for item in reversed(kept):
            self.pending.appendleft(item)
            self._pending_nbytes += item.example.nbytes
        candidates = [(e, self.version_decay ** a) for e in self.replay
                      if (key is None or batch_key(e) == key)
                      and (a := version_age(e.version)) is not None and a <= self.max_version_age]
        # replay_share of the batch: of a fresh part short of its budget (the stream paused), in proportion; a batch of
        # replay alone (no fresh record: replay_when_idle) is filled
        share = self.replay_share / (1.0 - self.replay_share)
        limit = min(batch_tokens, used + int(round(used * share))) if fresh else batch_tokens
        replayed, weights = [], []
        while candidates and used < limit:  # the last one may pass it, as the last fresh one fills a batch
            e, w = candidates.pop(self.rng.randrange(len(candidates)))
            replayed.append(e)
            weights.append(w)
            used += e.positions
        return fresh, replayed, weights

    def trained(self, examples: list[Example]) -> None:
        self.replay.extend(examples)


# ----------------------------------------------------------------------------------------------
# A file of records, read like a topic (offline distillation).


class FileSource:
    """Records from a JSON-lines file (`dvi stream tail --json` output) behind the consumer's interface
    (poll / positions / rewind; no group, so nothing to commit). Each line is parsed and validated once, by
    `dvi.records.from_dict`; lines that do not parse or validate are logged with their line number, counted
    (`stats.invalid`) and skipped."""

    group_id = None

    def __init__(self, path: str, vocab_size: int | None = None):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise DviError(f"record file {str(self.path)!r} not found (write one with `dvi stream tail --json > FILE`)")
        self.vocab_size = vocab_size
        self._lines = self.path.read_text().splitlines()
        self._next = 0
        self.stats = _FileStats()

    def poll(self, timeout_s: float = 0.0, max_records: int = 500) -> list[Delivered]:
        """Up to `max_records` records from the next lines (the file as `topic`, partition 0, the line index as offset)."""
        out = []
        while self._next < len(self._lines) and len(out) < max_records:
            n, line = self._next, self._lines[self._next]
            self._next += 1
            if not line.strip():
                continue
            try:
                record = from_dict(json.loads(line), self.vocab_size)
            except (ValueError, RecursionError) as e:  # RecordError and JSONDecodeError are ValueErrors
                self.stats.invalid += 1
                log.warning("%s:%d: skipping an invalid record: %s", self.path, n + 1, e)
                continue
            out.append(Delivered(record, str(self.path), 0, n))
        return out

    def positions(self) -> dict:
        return {(str(self.path), 0): self._next}

    def lag(self) -> int:
        return len(self._lines) - self._next

    def rewind(self) -> None:
        self._next = 0  # the ledger skips what the restored checkpoint already covers

    def close(self) -> None:
        pass


@dataclass
class _FileStats:
    invalid: int = 0  # lines skipped: not JSON, or not a valid record
