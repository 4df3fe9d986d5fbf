"""A consumer group with manual commits: it stops and a new member resumes exactly after the last commit."""

from __future__ import annotations

import pytest

from streams.consumer import DecisionConsumer
from streams.producer import DecisionProducer

pytestmark = pytest.mark.broker


def test_group_resumes_after_last_commit(stream_cfg, make_record):
    records = [make_record(f"req-{i}", rounds=2, seed=i) for i in range(30)]
    with DecisionProducer(stream_cfg) as producer:
        for r in records:
            producer.submit(r)
        assert producer.flush(15)

    with DecisionConsumer(stream_cfg, group_id="trainer") as first:
        committed = first.poll_until(12, timeout_s=20)
        assert len(committed) == 12
        first.commit()
        assert {tp: o for tp, o in first.committed().items() if o is not None} == first.positions()
        uncommitted = first.poll_until(18, timeout_s=10)  # read on, but crash before committing these
        assert len(uncommitted) == 18

    with DecisionConsumer(stream_cfg, group_id="trainer") as second:
        resumed = second.poll_until(18, timeout_s=20)
        assert second.poll(0.5) == []
        second.commit()
    ids = lambda ds: [d.record.record_id for d in ds]  # noqa: E731
    assert sorted(ids(resumed)) == sorted(ids(uncommitted))  # exactly the records after the commit, each once
    assert set(ids(committed)) | set(ids(resumed)) == {r.record_id for r in records}
    for d in resumed:  # and at the same offsets
        assert (d.partition, d.offset) in {(u.partition, u.offset) for u in uncommitted}
