"""Records to training data: examples against a plain per-round reference, packing, the ledger, offsets, the buffer,
a file of records."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from dvi.records import Delivered
from trainers.data import (Ahead, Buffer, Fate, FileSource, Item, Ledger, Offsets, collate, example_from_record,
                           pending_age_limit)


def reference_positions(record):
    """Per generated token, walking the rounds one decision at a time: (token, teacher ids, draft, reward)."""
    out = []
    for r in record.rounds:
        for j, token in enumerate(r.emitted):
            draft = r.drafted[j] if j < r.k else -1
            reward = 0.0 if j >= r.k else (1.0 if j < r.accepted else -1.0)
            out.append((token, r.topk_ids[j].tolist(), draft, reward))
    return out[: len(record.generated_ids)]


@pytest.mark.parametrize("chunk_index", [0, 2])
def test_every_generated_token_gets_the_decision_that_produced_it(make_record, chunk_index):
    record = make_record(chunk_index=chunk_index, rounds=6, k=3, topk=4, seed=chunk_index)
    ex = example_from_record(record, max_seq_len=10_000)
    ref = reference_positions(record)
    assert ex.positions == len(record.generated_ids) == len(ref)
    context = len(record.prompt_ids) + len(record.prefix_ids)
    assert ex.tokens.tolist() == record.prompt_ids + record.prefix_ids + record.generated_ids
    assert ex.targets.tolist() == list(range(context, context + ex.positions))
    for g, (token, ids, draft, reward) in enumerate(ref):
        assert ex.tokens[ex.targets[g]] == token
        assert ex.topk_ids[g].tolist() == ids
        assert ex.drafted[g] == draft
        assert ex.reward[g] == reward
        assert ex.judged[g] == (draft != -1)
    assert (ex.accepted, ex.drafted_total) == (record.accepted, record.drafted)
    assert ex.domain is None and example_from_record(replace(record, domain="math"), 10_000).domain == "math"


def test_long_records_keep_their_last_tokens(make_record):
    record = make_record(rounds=8, k=2, prompt_len=40)
    full = example_from_record(record, max_seq_len=10_000)
    cut = example_from_record(record, max_seq_len=12)
    assert len(cut.tokens) == 12 and cut.tokens.tolist() == full.tokens[-12:].tolist()
    assert cut.targets.min() >= 1  # every kept target has its predicting position inside the window
    kept = cut.positions
    assert 0 < kept <= 11
    assert cut.topk_ids.tolist() == full.topk_ids[-kept:].tolist()
    assert [cut.tokens[t] for t in cut.targets] == [full.tokens[t] for t in full.targets[-kept:]]


def same_batch(a, b) -> bool:
    tensors = ("input_ids", "attention_mask", "rows", "cols", "labels", "topk_ids", "topk_logprobs", "drafted", "reward",
               "judged", "weight")
    return a.record_ids == b.record_ids and all(torch.equal(getattr(a, t), getattr(b, t)) for t in tensors)


def test_a_batch_built_ahead_on_a_thread_is_the_one_collate_builds(make_record):
    """`Ahead` (a GPU's trainer builds the next batch on a worker thread while a step runs; forced here on the CPU):
    what `take` returns is what was submitted, its batch `collate`'s; `drop` forgets it; without a thread nothing is
    built ahead and `build` is `collate`."""
    groups = [[example_from_record(make_record(rounds=r, seed=10 * g + r), 10_000) for r in (2, 3)] for g in range(3)]
    ahead = Ahead(torch.device("cpu"), threaded=True)
    assert ahead.take() is None and not ahead.waiting
    ahead.submit("first", groups[0], [1.0, 0.5])
    with pytest.raises(RuntimeError, match="already waiting"):
        ahead.submit("second", groups[1], [1.0, 1.0])
    payload, batch = ahead.take()
    assert payload == "first" and same_batch(batch, collate(groups[0], [1.0, 0.5]))
    assert batch.to(torch.device("cpu")) is batch  # already there: no copy
    ahead.submit("second", groups[1], [1.0, 1.0])
    ahead.drop()
    assert ahead.take() is None
    ahead.close()

    inline = Ahead(torch.device("cpu"))  # no GPU: nothing built ahead
    assert not inline.threaded and same_batch(inline.build(groups[2], [1.0, 1.0]), collate(groups[2], [1.0, 1.0]))
    with pytest.raises(RuntimeError, match="nothing is built ahead"):
        inline.submit("x", groups[2], [1.0, 1.0])


def test_records_without_teacher_and_a_cut_last_round(make_record):
    record = make_record(rounds=3, k=4, topk=0)
    record.generated_ids = record.generated_ids[:-1]  # a stop token cut the last round short
    ex = example_from_record(record, max_seq_len=10_000)
    assert ex.topk_ids is None and ex.positions == len(record.generated_ids)


def test_collate_points_at_the_positions_that_predict_each_target(make_record):
    examples = [example_from_record(make_record(rounds=r, seed=r), 10_000) for r in (2, 5)]
    batch = collate(examples, [1.0, 0.5])
    assert batch.input_ids.shape == (2, max(len(e.tokens) for e in examples))
    assert batch.positions == sum(e.positions for e in examples)
    assert torch.equal(batch.labels, batch.input_ids[batch.rows, batch.cols + 1])
    assert bool(batch.attention_mask[batch.rows, batch.cols + 1].all())
    assert batch.weight.tolist() == [1.0] * examples[0].positions + [0.5] * examples[1].positions
    with pytest.raises(ValueError, match="teacher widths"):
        collate([examples[0], example_from_record(make_record(topk=0), 10_000)])


def test_ledger_remembers_fates_and_forgets_the_oldest():
    ledger = Ledger(size=3)
    for i, fate in enumerate([Fate.TRAINED, Fate.HELD_OUT, Fate.SKIPPED, Fate.TRAINED]):
        ledger.add(f"r{i}", fate)
    assert "r0" not in ledger and "r3" in ledger and len(ledger) == 3
    with pytest.raises(ValueError, match="already"):
        ledger.add("r3", Fate.TRAINED)
    again = Ledger(3, json.loads(json.dumps(ledger.entries())))  # through a checkpoint's JSON
    assert again.entries() == ledger.entries() == [["r1", "h"], ["r2", "s"], ["r3", "t"]]  # the values on disk
    assert [fate for _, fate in again.entries()].count(Fate.TRAINED) == 1


def test_offsets_commit_only_below_the_first_outstanding_record():
    off = Offsets()
    for o in range(5):
        off.consumed("p0", o)
    off.seen("p1", 7)
    for o in (0, 1, 3):
        off.done("p0", o)
    assert off.committable() == {"p0": 2, "p1": 8}
    off.done("p0", 2)
    assert off.committable() == {"p0": 4, "p1": 8}
    off.done("p0", 4)
    assert off.committable({"p0": 9}) == {"p0": 9, "p1": 8}  # the reader dead-lettered 5..8
    assert off.committable() == {"p0": 5, "p1": 8}  # nothing outstanding: the next offset


def test_offsets_of_a_lost_log_are_forgotten():
    off = Offsets()
    for o in range(5):
        off.consumed("p0", o)
    off.consumed("p1", 3)
    off.forget("p0")  # the broker lost p0's log: its offsets start again at 0
    off.consumed("p0", 0)
    assert off.committable() == {"p0": 0, "p1": 3}
    off.done("p0", 0)
    assert off.committable() == {"p0": 1, "p1": 3}


def _items(make_record, n, **kw):
    return [Item(example_from_record(make_record(rounds=2, k=1, seed=i, **kw), 10_000), "p", i) for i in range(n)]


def test_expire_takes_every_queued_item_logged_before_the_limit_wherever_it_waits(make_record):
    buf = Buffer(100, 8, 8, 0.0, 0.0, 0.5, 2)
    times = [100.0, 300.0, 150.0, 0.0, 199.0, 200.0]  # 0: a time unknown, never expired
    for item, t in zip(_items(make_record, len(times)), times):
        item.time = t
        buf.add(item)
    assert buf.expire(before=50.0) == []
    assert [i.offset for i in buf.expire(before=200.0)] == [0, 2, 4]  # the one behind a newer record too
    assert [i.offset for i in buf.pending] == [1, 3, 5] and buf.expire(before=200.0) == []
    assert [i.offset for i in buf.expire(before=1e12)] == [1, 5] and [i.offset for i in buf.pending] == [3]


def test_the_queue_age_limit_is_set_or_half_the_retention():
    assert pending_age_limit(90.0, 168.0) == 90.0
    assert pending_age_limit(None, 0.5) == 900.0 and pending_age_limit(None, 168.0) == 84 * 3600.0
    assert pending_age_limit(None, None) is None


def test_buffer_holds_out_by_prompt_and_skips_the_oldest_when_full(make_record):
    buf = Buffer(pending_size=4, replay_size=8, holdout_size=8, replay_share=0.0, holdout_share=0.25,
                 version_decay=0.5, max_version_age=2)
    items = _items(make_record, 40)
    fates = [buf.add(item) for item in items]
    held = [i for i, (fate, _) in enumerate(fates) if fate == Fate.HELD_OUT]
    assert held == [i for i, it in enumerate(items) if buf.held_out(it.example)]  # a fixed function of the prompt
    assert 4 <= len(held) <= 16  # about a quarter of 40 prompts
    queued = [i for i in range(40) if i not in held]
    dropped = [d.offset for _, ds in fates for d in ds]
    assert dropped == queued[:-4] and [i.offset for i in buf.pending] == queued[-4:]
    assert buf.pending_nbytes() == sum(i.example.nbytes for i in buf.pending) > 0
    # every record of a held-out prompt is held out: its later chunks, other samples, the question asked again
    prompt = make_record(rounds=2, k=1, seed=held[0]).prompt_ids
    again = [Item(example_from_record(replace(make_record(rounds=3, k=2, seed=77, chunk_index=c), prompt_ids=prompt), 10_000),
                  "p", 100 + c) for c in (0, 1)]
    assert all(buf.add(it)[0] == Fate.HELD_OUT for it in again)
    bounded = Buffer(100, 8, 8, 0.0, 0.0, 0.5, 2, pending_bytes=3 * items[0].example.nbytes)
    skipped = [d.offset for it in items[:5] for d in bounded.add(it)[1]]
    assert skipped == [0, 1] and len(bounded.pending) == 3  # in bytes too, the oldest first


def test_buffer_holds_out_the_first_prompts_then_a_share(make_record):
    buf = Buffer(pending_size=100, replay_size=8, holdout_size=8, replay_share=0.0, holdout_share=0.25,
                 version_decay=0.5, max_version_age=2, holdout_first=3)
    items = _items(make_record, 10)
    fates = [buf.add(item)[0] for item in items]
    share = Buffer(100, 8, 8, 0.0, 0.25, 0.5, 2)
    want = [0, 1, 2] + [i for i in range(3, 10) if share.held_out(items[i].example)]
    assert [i for i, fate in enumerate(fates) if fate == Fate.HELD_OUT] == want  # an early gate has records
    assert buf.add(Item(items[1].example, "p", 99))[0] == Fate.HELD_OUT  # that prompt stays held out
    none = Buffer(100, 8, 8, 0.0, 0.0, 0.5, 2, holdout_first=3)  # holdout_share 0: nothing is ever held out
    assert all(none.add(item)[0] is None for item in _items(make_record, 4))


def test_buffer_holds_out_the_first_prompts_of_every_domain_traffic_drifts_to(make_record):
    """After code, math: its first prompts are held out too, so the gate can judge the new domain on its own records
    (trainers.gate.judge) before 1 / holdout_share of its prompts have come."""
    share = Buffer(100, 8, 8, 0.0, 0.1, 0.5, 2)
    items = [it for it in _items(make_record, 40) if not share.held_out(it.example)][:12]  # outside the hashed share
    buf = Buffer(pending_size=100, replay_size=8, holdout_size=16, replay_share=0.0, holdout_share=0.1,
                 version_decay=0.5, max_version_age=2, holdout_first=2)
    domains = ["code"] * 6 + ["math"] * 4 + [None] * 2
    fates = [buf.add(Item(replace(it.example, domain=d), "p", i))[0] for i, (it, d) in enumerate(zip(items, domains))]
    assert [i for i, fate in enumerate(fates) if fate == Fate.HELD_OUT] == [0, 1, 6, 7, 10, 11]
    assert [e.domain for e in buf.holdout] == ["code", "code", "math", "math", None, None]


def test_buffer_trains_on_traffic_of_a_few_prompts_holding_out_their_share(make_record):
    """Two prompts asked over and over (a demo): both are among the first, yet the trainer gets most of their
    records; the held-out set keeps `holdout_first` of them, then the held-out share."""
    share = Buffer(100, 8, 8, 0.0, 0.1, 0.5, 2)
    two = [it for it in _items(make_record, 40) if not share.held_out(it.example)][:2]  # prompts outside the hashed share
    buf = Buffer(pending_size=1000, replay_size=8, holdout_size=100, replay_share=0.0, holdout_share=0.1,
                 version_decay=0.5, max_version_age=2, holdout_first=4)
    fates = [buf.add(Item(two[i % 2].example, "p", i))[0] for i in range(200)]
    held = [i for i, fate in enumerate(fates) if fate == Fate.HELD_OUT]
    assert held[:6] == [0, 1, 2, 3, 4, 5]  # the two first prompts, then 4 of their records as they come back
    assert 18 <= len(held) <= 22 and len(buf.pending) == 200 - len(held)  # then about a tenth


def test_buffer_batches_fresh_first_then_weighted_replay(make_record):
    buf = Buffer(pending_size=100, replay_size=100, holdout_size=1, replay_share=0.5, holdout_share=0.0,
                 version_decay=0.5, max_version_age=1, seed=1)
    items = _items(make_record, 6)
    per = items[0].example.positions
    for it in items[:4]:
        buf.add(it)
    fresh, replayed, _ = buf.take(batch_tokens=4 * per, version_age=lambda v: 0)
    assert [i.offset for i in fresh] == [0, 1] and not replayed  # half the budget, nothing to replay yet
    buf.trained([i.example for i in fresh])
    ages = {"v-test": 1}
    fresh, replayed, weights = buf.take(batch_tokens=4 * per, version_age=lambda v: ages.get(v))
    assert [i.offset for i in fresh] == [2, 3] and len(replayed) == 2 and weights == [0.5, 0.5]
    ages["v-test"] = 2  # too old: not replayed
    for it in items[4:]:
        buf.add(it)
    fresh, replayed, _ = buf.take(batch_tokens=4 * per, version_age=lambda v: ages.get(v))
    assert [i.offset for i in fresh] == [4, 5] and not replayed


def test_a_short_fresh_part_gets_replay_in_proportion_never_a_batch_of_replay(make_record):
    """The stream paused with one record waiting: the batch replays replay_share of it, not a batch's worth of old
    records (a few records replayed over and over pull a trained drafter away from everything else); with nothing
    fresh (replay_when_idle) replay fills the batch."""
    buf = Buffer(pending_size=100, replay_size=100, holdout_size=1, replay_share=0.5, holdout_share=0.0,
                 version_decay=0.5, max_version_age=4, seed=1)
    items = [it for it in _items(make_record, 40) if it.example.positions == 3][:13]  # records of one length
    buf.trained([i.example for i in items[:10]])  # ten records to replay
    buf.add(items[10])
    fresh, replayed, _ = buf.take(batch_tokens=8 * 3, version_age=lambda v: 0)
    assert [i.offset for i in fresh] == [items[10].offset] and len(replayed) == 1  # half of two records, not 7 of 8
    fresh, replayed, _ = buf.take(batch_tokens=8 * 3, version_age=lambda v: 0)
    assert not fresh and len(replayed) == 8  # nothing fresh: a whole batch of replay
    quarter = Buffer(100, 100, 1, 0.25, 0.0, 0.5, 4, seed=1)
    quarter.trained([i.example for i in items[:10]])
    quarter.add(items[11])
    quarter.add(items[12])
    fresh, replayed, _ = quarter.take(batch_tokens=8 * 3, version_age=lambda v: 0)
    assert len(fresh) == 2 and len(replayed) == 1  # a quarter of three records: one, not six


def test_buffer_never_mixes_teacher_widths(make_record):
    buf = Buffer(100, 100, 1, 0.0, 0.0, 0.5, 4)
    a, b = _items(make_record, 2), _items(make_record, 2, topk=0)
    for it in (a[0], b[0], a[1], b[1]):
        buf.add(it)
    fresh, _, _ = buf.take(10_000, lambda v: 0)
    assert [i.example.topk_ids is not None for i in fresh] == [True, True]
    fresh, _, _ = buf.take(10_000, lambda v: 0)
    assert [i.example.topk_ids is None for i in fresh] == [True, True]
    assert np.array_equal(fresh[0].example.tokens, b[0].example.tokens)


def test_file_source_delivers_valid_records_and_counts_the_rest(make_record, tmp_path, caplog):
    good = [make_record(rounds=2, seed=i) for i in range(3)]
    other_vocab = make_record(rounds=2, vocab=1000, seed=9)
    bad_ids = make_record(rounds=2, seed=7).to_dict()
    bad_ids["generated_ids"][0] = 10**9  # outside the vocabulary
    lines = [json.dumps(good[0].to_dict()), "{not json", json.dumps(good[1].to_dict()), "",
             json.dumps(bad_ids), json.dumps(other_vocab.to_dict()), json.dumps(good[2].to_dict())]
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = FileSource(str(path), vocab_size=good[0].target.vocab_size)
    first = source.poll(max_records=2)
    rest = source.poll()
    assert all(isinstance(d, Delivered) for d in first + rest)
    assert [d.record.record_id for d in first + rest] == [r.record_id for r in good]
    assert [(d.topic, d.partition, d.offset) for d in first + rest] == [(str(path), 0, n) for n in (0, 2, 6)]
    assert source.stats.invalid == 3  # not JSON, an id outside the vocabulary, another target's vocabulary
    assert "records.jsonl:2: skipping an invalid record" in caplog.text
    assert "records.jsonl:6: skipping an invalid record: target.vocab_size" in caplog.text
    assert source.positions() == {(str(path), 0): len(lines)} and source.lag() == 0
    source.rewind()
    assert len(source.poll()) == 3


def test_records_of_a_later_minor_schema_and_of_schema_1_train_like_this_builds_own(make_record):
    """A writer that added fields (schema 2.4: a number, a string and an array) still feeds this trainer, and so
    does a record written before schema 2 (schema 1, read by `dvi.records_v1`)."""
    from broker_fixtures import newer_writer

    from dvi import records_v1
    from dvi.record_codec import decode, encode

    record = make_record(rounds=5, seed=3)
    later = decode(newer_writer(encode(record), minor=4, acceptance_hint=0.5, novelty="x", future_arrays=b"\x07" * 40))
    older = decode(records_v1.encode(record))
    a = example_from_record(decode(encode(record)), 10_000)
    for b in (example_from_record(later, 10_000), example_from_record(older, 10_000)):
        for name in ("tokens", "targets", "topk_ids", "topk_logprobs", "drafted", "reward", "judged"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        assert (a.record_id, a.version, a.accepted) == (b.record_id, b.version, b.accepted)
    batch = collate([b])  # and it batches
    assert batch is not None


def test_replay_and_holdout_are_bounded_in_bytes_the_oldest_leaving_first(make_record):
    """Long records cannot fill the trainer's memory: past the byte bound the oldest examples leave, whatever the
    record count allows; one example larger than the whole bound is still kept alone (the newest always stays)."""
    small = [example_from_record(make_record(rounds=2, k=1, seed=i), 10_000) for i in range(6)]
    big = example_from_record(make_record(rounds=40, k=4, seed=99), 10_000)
    assert big.nbytes > 5 * small[0].nbytes
    bound = 3 * small[0].nbytes + small[0].nbytes // 2  # room for three small ones
    buf = Buffer(100, replay_size=100, holdout_size=100, replay_share=0.5, holdout_share=0.0, version_decay=1.0,
                 max_version_age=10, replay_bytes=bound, holdout_bytes=bound)
    buf.trained(small)
    assert [e.record_id for e in buf.replay] == [e.record_id for e in small[-3:]] and buf.replay.nbytes <= bound
    buf.trained([big])
    assert [e.record_id for e in buf.replay] == [big.record_id] and buf.replay.nbytes == big.nbytes
    buf.holdout.extend(small)
    assert len(buf.holdout) == 3 and buf.holdout.nbytes == sum(e.nbytes for e in small[-3:])
    # the count bound still holds as before
    counted = Buffer(100, replay_size=2, holdout_size=2, replay_share=0.5, holdout_share=0.0, version_decay=1.0, max_version_age=10)
    counted.trained(small)
    assert [e.record_id for e in counted.replay] == [e.record_id for e in small[-2:]]
