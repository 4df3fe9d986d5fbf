"""The control protocol's codec: every message round-trips, and anything else is refused with a reason."""

from __future__ import annotations

import json

import pytest

from dvi.control import MAX_BYTES, ControlError, DrafterPromoted, DrafterPublished, DrafterRejected, RetrainRequested, decode, encode

MESSAGES = [
    DrafterPublished("d0001", "/store/d0001", "ab" * 32, parent="init-L2-full", gate={"candidate_acceptance": 0.4}),
    DrafterRejected("d0002", "replica-a", reason="live acceptance 0.1 < 0.4", previous="d0001"),
    DrafterPromoted("d0001", "replica-a", acceptance=0.42),
    RetrainRequested("dvi retrain"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.kind)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg
    assert json.loads(encode(msg))["type"] == msg.kind


def test_unknown_fields_are_ignored_so_a_newer_writer_can_add_one():
    data = json.dumps({"type": "drafter_promoted", "version": "d1", "replica_id": "r", "time": 1.0, "new_field": [1]})
    assert decode(data.encode()) == DrafterPromoted("d1", "r", time=1.0)


@pytest.mark.parametrize("data, words", [
    (b"\xff\xfe", "not JSON"),
    (b"{not json", "not JSON"),
    (b"[" * 5000 + b"]" * 5000, "not JSON"),  # deep nesting: RecursionError inside json, refused like any bad JSON
    (b"[1, 2]", "JSON object"),
    (b'{"version": "d1"}', "unknown message type"),
    (b'{"type": "drafter_exploded"}', "unknown message type"),
    (b'{"type": "drafter_published", "version": "d1", "uri": "/x"}', "without sha256"),
    (b'{"type": "drafter_published", "version": 7, "uri": "/x", "sha256": "ab"}', "version"),
    (b'{"type": "drafter_published", "version": "", "uri": "/x", "sha256": "ab"}', "version"),
    (b'{"type": "drafter_published", "version": "d1", "uri": "/x", "sha256": "ab", "gate": {"a": "high"}}', "gate"),
    (b'{"type": "drafter_promoted", "version": "d1", "replica_id": "r", "acceptance": NaN}', "acceptance"),
    (b'{"type": "retrain", "time": true}', "time"),
    (b" " * (MAX_BYTES + 1), "bound"),
    (b'{"type": "drafter_published", "version": "../d1", "uri": "/x", "sha256": "ab"}', "version name"),
    (b'{"type": "drafter_rejected", "version": "d1/x", "replica_id": "r"}', "version name"),
    (b'{"type": "drafter_rejected", "version": "d1", "replica_id": "r", "previous": ".."}', "version name"),
    (b'{"type": "drafter_rejected", "version": "' + b"v" * 65 + b'", "replica_id": "r"}', "version name"),
    (b'{"type": "drafter_rejected", "version": "d1", "replica_id": "r", "reason": "' + b"x" * 1001 + b'"}', "reason"),
    (b'{"type": "drafter_published", "version": "d1", "uri": "/x", "sha256": "ab", "gate": {'
     + b", ".join(b'"g%d": 1' % i for i in range(33)) + b"}}", "gate"),
])
def test_anything_else_is_refused_with_what_is_wrong(data, words):
    with pytest.raises(ControlError, match=words):
        decode(data)


def test_a_verifier_with_a_seen_file_refuses_replays_across_restarts(tmp_path):
    """What a verifier accepted stays a replay for the next verifier on the same file while it is within MAX_AGE_S;
    one older than that is dropped from the file; another reader's file is no record of this one's."""
    from dvi import keys
    from dvi.control import MAX_AGE_S, Verifier

    k = keys.load(tmp_path / "keys", sign_as=("trainer",))
    seen = tmp_path / "replica.seen"
    first, second = (encode(DrafterPublished(f"d000{i}", f"/s/d000{i}", "ab" * 32), k) for i in (1, 2))
    assert Verifier(k, seen_file=seen)(first).version == "d0001"
    restarted = Verifier(k, seen_file=seen)
    with pytest.raises(ControlError, match="replay"):
        restarted(first)
    assert restarted(second).version == "d0002"
    assert Verifier(k, seen_file=tmp_path / "another.seen")(first).version == "d0001"
    assert len(seen.read_text().splitlines()) == 2
    later = Verifier(k, seen_file=seen)
    later._load_seen(now=json.loads(seen.read_text().splitlines()[0])["t"] + MAX_AGE_S + 1)  # both past their window
    assert seen.read_text() == ""
