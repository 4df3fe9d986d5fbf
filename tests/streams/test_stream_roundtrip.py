"""Records through the real broker: round trip of engine records, and per-request ordering (key = request id)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from dvi.config import SpecConfig
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.record_codec import decode, encode
from dvi.records import records_from_result
from streams.consumer import DecisionConsumer
from streams.producer import DecisionProducer

pytestmark = pytest.mark.broker


def test_engine_records_round_trip(stream_cfg, tiny_target, tiny_drafter, one_thread):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, SpecConfig(k=4, adaptive=False, topk_logprobs=8))
    reqs = [Request([1, 2, 3, 4, 5], max_new_tokens=60, temperature=0.8, seed=s) for s in range(4)]
    sent = [
        rec
        for req, res in zip(reqs, engine.generate(reqs))
        for rec in records_from_result(res, replica_id="r0", target_name="tiny", vocab_size=97, sampling=req, chunk_rounds=8)
    ]
    with DecisionProducer(stream_cfg) as producer:
        assert all(producer.submit(r) for r in sent)
        assert producer.flush(15)
    assert producer.stats.sent == len(sent) and producer.stats.dropped == 0

    with DecisionConsumer(stream_cfg, group_id=None, vocab_size=97) as consumer:
        got = consumer.poll_until(len(sent), timeout_s=15)
        assert consumer.poll(0.2) == []  # nothing else on the topic
    assert consumer.stats.delivered == len(sent) and consumer.stats.invalid == 0
    by_id = {d.record.record_id: d for d in got}
    assert len(by_id) == len(sent)
    for rec in sent:
        d = by_id[rec.record_id]
        assert d.key == rec.request_id.encode() and d.topic == stream_cfg.topic
        # what arrives is exactly what the wire format makes of the record (float16 log-probs)
        assert d.record == decode(encode(rec))


def test_per_request_order(stream_cfg, make_record):
    """Chunks of a request are submitted interleaved with other requests; each request's chunks arrive in order."""
    n_req, n_chunks = 24, 5
    chunks = {f"req-{i:02d}": [make_record(f"req-{i:02d}", chunk_index=c, final=c == n_chunks - 1, rounds=2, seed=i * 10 + c)
                               for c in range(n_chunks)] for i in range(n_req)}
    with DecisionProducer(stream_cfg) as producer:
        for c in range(n_chunks):
            for rid in chunks:
                producer.submit(chunks[rid][c])
        assert producer.flush(15)
    with DecisionConsumer(stream_cfg, group_id=None) as consumer:
        got = consumer.poll_until(n_req * n_chunks, timeout_s=15)
    assert len(got) == n_req * n_chunks
    seen = defaultdict(list)
    for d in sorted(got, key=lambda d: (d.partition, d.offset)):
        seen[d.record.request_id].append((d.partition, d.record.chunk_index, d.record.record_id))
    assert len({p for v in seen.values() for p, _, _ in v}) > 1  # requests spread over partitions
    for rid, arrived in seen.items():
        assert len({p for p, _, _ in arrived}) == 1, rid  # one partition per request
        assert [c for _, c, _ in arrived] == list(range(n_chunks)), rid  # in order
        assert [x for _, _, x in arrived] == [r.record_id for r in chunks[rid]]
