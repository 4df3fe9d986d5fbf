"""A consumer group with manual commits: it stops and a new member resumes exactly after the last commit; a member
that reads less often than its poll interval leaves the group and cannot commit."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from kafka.errors import CommitFailedError, RebalanceInProgressError

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


@pytest.mark.slow
def test_a_member_that_reads_less_often_than_its_poll_interval_cannot_commit_and_a_longer_interval_can(stream_cfg, make_record):
    """kafka-python makes a member leave its group when it has not polled for `max_poll_interval_ms`: its commit then
    fails and its next read starts over from the last commit. A trainer step beside busy engines takes minutes, so the
    trainer's consumer reads with `stream.max_poll_interval_ms` (30 minutes by default), not kafka-python's 5."""
    with DecisionProducer(stream_cfg) as producer:
        for i in range(8):
            producer.submit(make_record(f"req-{i}", rounds=2, seed=i))
        assert producer.flush(15)
    short = replace(stream_cfg, session_timeout_ms=3000, max_poll_interval_ms=3000)
    with DecisionConsumer(short, group_id="slow-step") as member:
        assert len(member.poll_until(8, timeout_s=20)) == 8
        time.sleep(5)  # a step longer than its poll interval
        with pytest.raises((CommitFailedError, RebalanceInProgressError)):
            member.commit()
    with DecisionConsumer(replace(short, max_poll_interval_ms=20000), group_id="slow-step-2") as member:
        assert len(member.poll_until(8, timeout_s=20)) == 8
        time.sleep(5)  # the same step, within its poll interval
        member.commit()
        assert {tp: o for tp, o in member.committed().items() if o is not None} == member.positions()
