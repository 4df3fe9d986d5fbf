"""DecisionRecords without a broker: records from engine results, the wire format, and validation of bad records."""

from __future__ import annotations

import copy
import json
import random
import struct
import time
import tracemalloc
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
from broker_fixtures import make_record

from dvi.config import SpecConfig
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request, Result, Round, SpecStats
from dvi.errors import DviError
from broker_fixtures import NEWER_FIELDS, edit_message, newer_writer, newer_writer_v1, rewrap_v1

from dvi import records_v1
from dvi.record_codec import SCHEMA_MINOR, Limits, check_headers, decode, encode, kafka_headers
from dvi.record_proto import message_class, proto_text
from dvi.records import CONTENT_TYPE, READS, DecisionRecord, RecordError, RoundRecord, Sampling, Target, records_from_result, validate

VOCAB = 97


def hand_result(versions=("v1",) * 6, k=3, topk=4, prompt=(5, 6, 7), seed=0, cut_last=0) -> Result:
    """A Result built by hand: rounds with the given drafter versions (None: a plain round), consistent tokens."""
    gen = torch.Generator().manual_seed(seed)
    rounds, tokens = [], []
    for i, v in enumerate(versions):
        kk = k if v is not None else 0
        drafted = torch.randint(0, VOCAB, (kk,), generator=gen).tolist()
        acc = int(torch.randint(0, kk + 1, (1,), generator=gen)) if kk else 0
        if cut_last and i == len(versions) - 1:  # the last round emits k + 1 tokens; the stop cuts some off
            acc = kk
        token = int(torch.randint(0, VOCAB, (1,), generator=gen))
        lp, ids = torch.log_softmax(torch.randn(kk + 1, VOCAB, generator=gen), -1).topk(topk, -1) if topk else (None, None)
        rounds.append(Round(len(tokens), kk, drafted, acc, token, v, ids, lp))
        tokens += drafted[:acc] + [token]
    if cut_last:
        tokens = tokens[:-cut_last]
    stats = SpecStats()
    for r in rounds:
        stats.add(r.k, r.accepted)
    return Result("req-1", list(prompt), tokens, "length", [v for v in dict.fromkeys(versions) if v], rounds, stats, 0.1)


def records(result: Result, **kw) -> list[DecisionRecord]:
    args = dict(replica_id="replica-a", target_name="tiny", vocab_size=VOCAB, sampling=Sampling(0.7, 0.9, 3), chunk_rounds=64)
    args.update(kw)
    return records_from_result(result, **args)


@pytest.fixture
def record() -> DecisionRecord:
    return records(hand_result(cut_last=1))[0]


# ----------------------------------------------------------------------------------------------
# From engine results.


def test_records_from_a_real_engine_result_round_trip(tiny_target, tiny_drafter, one_thread):
    engine = SpeculativeEngine(tiny_target, tiny_drafter, SpecConfig(k=4, adaptive=False, topk_logprobs=8), stop_ids={3})
    reqs = [Request([1, 2, 3, 4], max_new_tokens=80, temperature=0.8, seed=s) for s in range(2)] + [Request([9, 8], max_new_tokens=50)]
    for req, result in zip(reqs, engine.generate(reqs)):
        recs = records(result, sampling=req, chunk_rounds=7, domain="code")
        assert len(recs) == -(-len(result.rounds) // 7)
        assert [r.chunk_index for r in recs] == list(range(len(recs)))
        assert [r.final for r in recs] == [False] * (len(recs) - 1) + [True]
        assert sum((r.generated_ids for r in recs), []) == result.token_ids
        for r in recs:
            validate(r, VOCAB)
            assert r.prompt_ids == req.prompt_ids
            assert r.prefix_ids == result.token_ids[: r.rounds[0].position]
            assert r.request_id == result.request_id and r.domain == "code" and r.drafter_version == "noisy-v1"
            assert r.sampling == Sampling(req.temperature, req.top_p, req.seed)
            assert all(x.topk_ids.shape == (x.k + 1, 8) for x in r.rounds)
            assert decode(encode(r, logprob_dtype="float32"), VOCAB) == r  # float32: exact
            back = decode(encode(r), VOCAB)  # float16 log-probs: ids exact, log-probs to half precision
            assert back.to_dict()["generated_ids"] == r.generated_ids and back.record_id == r.record_id
            for a, b in zip(back.rounds, r.rounds):
                np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
                np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, rtol=2e-3, atol=2e-3)
    ids = {r.record_id for res in engine.generate(reqs[:1]) for r in records(res, chunk_rounds=3)}
    assert len(ids) > 1 and all(len(i) == 32 for i in ids)  # unique record ids


def test_chunks_split_where_the_drafter_changes():
    result = hand_result(versions=("v1", None, "v1", "v2", None, "v2", "v2", "v3"))
    recs = records(result, chunk_rounds=3)
    assert [(r.drafter_version, len(r.rounds)) for r in recs] == [("v1", 3), ("v2", 3), ("v2", 1), ("v3", 1)]
    assert sum((r.generated_ids for r in recs), []) == result.token_ids
    plain = records(hand_result(versions=(None, None)))
    assert plain[0].drafter_version is None and plain[0].drafted == 0


def test_topk_is_cut_to_the_stream_setting_and_zero_means_none():
    result = hand_result(topk=6)
    four = records(result, topk=4)[0]
    assert all(x.topk_ids.shape == (x.k + 1, 4) for x in four.rounds)
    np.testing.assert_array_equal(four.rounds[0].topk_ids, result.rounds[0].topk_ids[:, :4].numpy())
    none = records(result, topk=0)[0]
    assert none.topk == 0 and all(x.topk_logprobs.shape == (x.k + 1, 0) for x in none.rounds)
    assert decode(encode(none)) == none
    assert len(encode(none)) < len(encode(four))
    with pytest.raises(DviError, match="serve.spec.topk_logprobs"):
        records(hand_result(topk=0), topk=8)


# ----------------------------------------------------------------------------------------------
# Validation of hand-made bad records.


def broken(record: DecisionRecord, path: str, value) -> DecisionRecord:
    bad = copy.deepcopy(record)
    obj = bad
    *parents, last = path.split(".")
    for p in parents:
        obj = obj.rounds[int(p[7:-1])] if p.startswith("rounds[") else getattr(obj, p)
    setattr(obj, last, value)
    return bad


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("schema_version", 3, "schema_version"),
        ("record_id", "not-hex", "record_id"),
        ("request_id", 17, "request_id"),
        ("replica_id", "", "replica_id"),
        ("domain", "bad!", "domain"),
        ("domain", "a/b", "domain"),
        ("chunk_index", -1, "chunk_index"),
        ("final", 1, "final"),
        ("time", float("nan"), "time"),
        ("target", ("tiny", VOCAB), "target"),
        ("sampling", Sampling(-1.0), "sampling.temperature"),
        ("sampling", Sampling(1.0, 1.5), "sampling.top_p"),
        ("prompt_ids", [], "prompt_ids"),
        ("prompt_ids", [1, "2"], "prompt_ids"),
        ("prompt_ids", [1, 2.0], "prompt_ids"),
        ("prompt_ids", [True], "prompt_ids"),
        ("prompt_ids", [1, VOCAB], "prompt_ids"),
        ("prompt_ids", [-1], "prompt_ids"),
        ("generated_ids", "abc", "generated_ids"),
        ("rounds", [], "rounds"),
        ("topk", -1, "topk"),
        ("rounds[0].k", 2.0, "rounds[0].k"),
        ("rounds[0].drafted", [1, 2], "rounds[0].drafted"),
        ("rounds[0].accepted", 4, "rounds[0].accepted"),
        ("rounds[0].token", VOCAB + 5, "rounds[0].token"),
        ("rounds[1].position", 99, "rounds[1].position"),
        ("rounds[0].topk_ids", np.zeros((3, 4), np.int32), "rounds[0].topk_ids"),
        ("rounds[0].topk_ids", np.full((4, 4), VOCAB, np.int32), "rounds[0].topk_ids"),
        ("rounds[0].topk_ids", [[0] * 4] * 4, "rounds[0].topk_ids"),
        ("rounds[0].topk_logprobs", np.zeros((4, 3), np.float32), "rounds[0].topk_logprobs"),
        ("rounds[0].topk_logprobs", np.full((4, 4), np.nan, np.float32), "rounds[0].topk_logprobs"),
        ("rounds[0].topk_logprobs", np.full((4, 4), -np.inf, np.float32), "rounds[0].topk_logprobs"),
        ("rounds[0].topk_logprobs", np.full((4, 4), 0.5, np.float32), "rounds[0].topk_logprobs"),
        ("rounds[0].topk_logprobs", np.zeros((4, 4), np.int32), "rounds[0].topk_logprobs"),
    ],
)
def test_validation_names_the_bad_field(record, path, value, field):
    validate(record, VOCAB)
    bad = broken(record, path, value)
    with pytest.raises(RecordError) as e:
        validate(bad)
    assert e.value.field == field and str(e.value).startswith(field)
    with pytest.raises(RecordError):
        encode(bad)  # the producer side validates too


def test_generated_ids_must_match_what_the_rounds_emit(record):
    bad = broken(record, "generated_ids", list(record.generated_ids))
    bad.generated_ids[0] = (bad.generated_ids[0] + 1) % VOCAB
    with pytest.raises(RecordError, match=r"rounds\[0\]"):
        validate(bad)
    # only the last round of the final chunk may be cut short
    with pytest.raises(RecordError):
        validate(broken(record, "final", False))
    with pytest.raises(RecordError):
        validate(broken(record, "generated_ids", record.generated_ids + [1]))


def test_consumer_vocabulary_must_match(record):
    with pytest.raises(RecordError, match="target.vocab_size"):
        decode(encode(record), vocab_size=49152)


# ----------------------------------------------------------------------------------------------
# Bad bytes.


def test_bad_bytes_raise_record_error(record):
    data = encode(record)
    assert decode(data) == decode(bytes(data))

    def cut(name, n):
        return lambda m: setattr(m, name, getattr(m, name)[:n])

    cases = {
        "garbage": (bytes(range(1, 256)) * 3, "magic"),
        "empty": (b"", "magic"),
        "pickle": (b"\x80\x04\x95" + bytes(40), "magic"),
        "framing cut": (data[:5], "record"),
        "message index": (data[:5] + b"\x02" + data[6:], "framing"),  # [5]: the next byte read as an index
        "two message indexes": (data[:5] + b"\x04\x00\x00" + data[6:], "framing"),
        "no time": (edit_message(data, lambda m: m.ClearField("time")), "time"),
        "trailing garbage": (data + b"\xff\xff", "payload"),
        "truncated": (data[: len(data) // 2], "payload"),
        "no target": (edit_message(data, lambda m: m.ClearField("target")), "target"),
        "id width": (edit_message(data, lambda m: setattr(m, "id_bytes", 3)), "id_bytes"),
        "log-prob width": (edit_message(data, lambda m: setattr(m, "logprob_bytes", 8)), "logprob_bytes"),
        "rounds cut": (edit_message(data, cut("rounds", -4)), "rounds"),
        "drafts cut": (edit_message(data, cut("drafted", -2)), "drafted"),
        "teacher ids cut": (edit_message(data, cut("topk_ids", -2)), "topk_ids"),
        "log-probs odd": (edit_message(data, cut("topk_logprobs", -1)), "topk_logprobs"),
        "no record id": (edit_message(data, lambda m: m.ClearField("record_id")), "record_id"),
    }
    for name, (bad, field) in cases.items():
        with pytest.raises(RecordError) as e:
            decode(bad)
        assert e.value.field == field, (name, str(e.value))


def test_bad_schema_1_bytes_raise_record_error(record):
    """The reader of schema 1 (records written before an upgrade) is as strict as it always was; what it reads says
    which schema carried it."""
    data = records_v1.encode(record)
    assert decode(data) == decode(encode(record))
    assert (decode(data).schema_version, decode(encode(record)).schema_version) == (1, 2)
    for key, value in (("time", 10**400), ("seed", 2**70)):
        def edit(p, key=key, value=value):
            (hlen,) = struct.unpack_from("<I", p)
            h = json.loads(bytes(p[4 : 4 + hlen]))
            (h["sampling"] if key == "seed" else h)[key] = value
            head = json.dumps(h).encode()
            return struct.pack("<I", len(head)) + head + bytes(p[4 + hlen :])
        with pytest.raises(RecordError) as e:  # not an OverflowError
            decode(rewrap_v1(data, edit))
        assert e.value.field in ("time", "sampling.seed"), str(e.value)
    cases = {
        "schema v9": (data[:4] + struct.pack("<H", 9) + data[6:], "schema_version"),
        "flags": (data[:6] + struct.pack("<H", 1) + data[8:], "flags"),
        "trailing": (data + b"xx", "payload"),
        "declared length": (data[:8] + struct.pack("<I", 10) + data[12:], "payload"),
        "zip bomb": (data[:8] + struct.pack("<I", 1 << 31) + data[12:], "payload"),
        "header not JSON": (rewrap_v1(data, lambda p: p[:4] + b"{" * (len(p) - 4)), "header"),
        "unknown header key": (rewrap_v1(data, lambda p: p.replace(b'"domain"', b'"dOmain"')), "header"),
        "arrays cut": (rewrap_v1(data, lambda p: p[:-3]), "topk_logprobs"),
        "arrays extra": (rewrap_v1(data, lambda p: p + b"\0\0"), "payload"),
    }
    for n in (5, 12, 13, len(data) // 2, len(data) - 1):
        cases[f"truncated at {n}"] = (data[:n], "record" if n < 12 else "payload")
    for name, (bad, field) in cases.items():
        with pytest.raises(RecordError) as e:
            decode(bad)
        assert e.value.field == field, (name, str(e.value))


def test_size_bound(record):
    data = encode(record)
    with pytest.raises(RecordError, match="exceeds"):
        encode(record, max_bytes=len(data) - 1)
    with pytest.raises(RecordError, match="exceeds"):
        decode(data, max_bytes=len(data) - 1)
    assert decode(data, max_bytes=len(data)) == decode(data)


def test_ids_out_of_range_and_nan_in_bytes_are_rejected(record):
    bad_ids = broken(record, "rounds[0].drafted", [VOCAB + 1] + record.rounds[0].drafted[1:])
    lp = record.rounds[1].topk_logprobs.copy()
    lp[0, 0] = np.nan
    bad_lp = broken(record, "rounds[1].topk_logprobs", lp)
    with mock.patch("dvi.record_codec.validate"):  # a producer that does not validate
        ids_bytes, lp_bytes = encode(bad_ids), encode(bad_lp)
    with pytest.raises(RecordError, match="outside the vocabulary"):
        decode(ids_bytes)
    with pytest.raises(RecordError, match="non-finite") as e:
        decode(lp_bytes)
    assert e.value.field == "rounds[1].topk_logprobs"
    # an accepted draft out of range is reported as such, not as a mismatch with generated_ids
    i = next(j for j, r in enumerate(record.rounds) if r.accepted)
    accepted_bad = broken(record, f"rounds[{i}].drafted", [VOCAB + 3] + record.rounds[i].drafted[1:])
    with pytest.raises(RecordError, match="outside the vocabulary") as e:
        validate(accepted_bad)
    assert e.value.field == f"rounds[{i}].drafted"


def test_random_corruption_never_escapes_as_another_error(record):
    """Flip bytes of a record (and of a schema-1 record's compressed payload): decode returns a valid record or
    RecordError."""
    data, old = encode(record), records_v1.encode(record)
    rng = random.Random(0)
    outcomes = {"ok": 0, "error": 0}
    for i in range(600):
        def flip(p, i=i):
            for _ in range(rng.randint(1, 3)):
                p[rng.randrange(len(p))] = rng.randrange(256)
        if i % 3 == 2:
            bad = rewrap_v1(old, flip)
        else:
            bad = bytearray(data if i % 3 else old)
            flip(bad)
        try:
            validate(decode(bad))
            outcomes["ok"] += 1
        except RecordError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100


def test_wire_format_is_protobuf_in_the_registry_framing_and_not_pickle(record):
    """Confluent's framing (byte 0, the schema id, message index 0), then a DecisionRecord that a protobuf reader
    built from the printed schema alone parses; float16 log-probs make it smaller than float32."""
    data = encode(record, schema_id=4242)
    assert data[0] == 0 and int.from_bytes(data[1:5], "big") == 4242 and data[5] == 0
    assert decode(data[:5] + b"\x02\x00" + data[6:]) == decode(data)  # [0] as the full array: count 1, index 0
    assert list(message_class().DESCRIPTOR.file.message_types_by_name)[0] == "DecisionRecord"  # what index [0] names
    assert proto_text().index("message DecisionRecord") < proto_text().index("message Target")
    assert b"\x80\x04" not in data[:2] and decode(data) == decode(encode(record, logprob_dtype="float16"))
    m = message_class()()
    m.ParseFromString(data[6:])
    assert (m.request_id, m.target.vocab_size, m.topk, m.minor) == (record.request_id, VOCAB, record.topk, SCHEMA_MINOR)
    for field_name in ("record_id", "target", "drafter_version", "topk_logprobs"):
        assert f" {field_name} = " in proto_text()
    assert len(data) < len(encode(record, logprob_dtype="float32"))
    with pytest.raises(DviError, match="schema_id"):
        encode(record, schema_id=1 << 31)
    untouched = RoundRecord(0, 0, [], 0, 1, np.zeros((1, 0), np.int32), np.zeros((1, 0), np.float32))
    assert untouched == copy.deepcopy(untouched) and untouched != record.rounds[0]
    assert Target("tiny", VOCAB) == record.target


def test_optional_fields_keep_none_apart_from_empty_and_zero(record):
    """drafter_version, domain and seed are absent or present: None is not "" or 0 after a round trip."""
    for version, domain, seed in ((None, None, None), ("d0001", "code", 0), ("v", "prose", -7)):
        r = copy.copy(record)
        r.drafter_version, r.domain, r.sampling = version, domain, Sampling(0.7, 0.9, seed)
        back = decode(encode(r))
        assert (back.drafter_version, back.domain, back.sampling) == (version, domain, Sampling(0.7, 0.9, seed))


LIMITS = Limits(topk=8, max_rounds=64, max_k=8)


def test_a_reader_with_limits_refuses_records_beyond_them_before_reading_their_arrays():
    assert decode(encode(make_record("ok", rounds=64, k=8, topk=8)), limits=LIMITS).request_id == "ok"
    cases = {
        "teacher width": make_record(rounds=2, topk=4),  # a width other than stream.topk
        "more than the 64 of a chunk": make_record(rounds=65, k=2),
        "more than serve.spec.k_max": make_record(rounds=2, k=9),
        "tokens, more than": make_record(rounds=1, prompt_len=LIMITS.max_tokens),
    }
    for words, record in cases.items():
        data = encode(record)
        decode(data)  # valid: only the reader's limits refuse it
        with pytest.raises(RecordError, match=words):
            decode(data, limits=LIMITS)


def test_the_largest_valid_record_decodes_and_a_bomb_costs_no_more_than_it():
    """A record at every limit decodes; a larger one is refused by its size before it is parsed; a schema-1 payload
    of 32 MiB compressed into a few KiB is refused by its declared size, and decoding it allocates at most a few MiB."""
    biggest = make_record("max", rounds=LIMITS.max_rounds, k=LIMITS.max_k, topk=LIMITS.topk,
                          prompt_len=LIMITS.max_tokens - 2 * LIMITS.max_rounds * (LIMITS.max_k + 1))
    data = encode(biggest, logprob_dtype="float32")
    assert decode(data, limits=LIMITS).request_id == "max"
    padded = newer_writer(data, future_arrays=b"\x00" * LIMITS.payload_bytes())
    with pytest.raises(RecordError, match="more than the largest valid record"):
        decode(padded, limits=LIMITS)
    payload = b"\x00" * (32 << 20)
    bomb = struct.pack("<4sHHI", records_v1.MAGIC, 1, 0, len(payload)) + zlib.compress(payload, 9)
    assert len(bomb) < 64 << 10
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(RecordError, match="decompression bound"):
        decode(bomb, limits=LIMITS)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"\nbomb of {len(bomb)} bytes (32 MiB inflated) refused in {seconds * 1000:.2f} ms, peak {peak / 2**20:.2f} MiB")
    assert peak < 10 << 20
    assert LIMITS.payload_bytes() < 1 << 20  # the default limits: under 1 MiB, against 64 MiB without them


def test_a_newer_minor_version_is_read_and_its_additions_skipped(record):
    """A writer of schema 2.3 added fields (a string, a number, an array): this build reads the fields it knows and
    skips the others; its own fields keep their checks."""
    data = encode(record)
    later = newer_writer(data, minor=3, novelty="future", acceptance_hint=0.5, future_arrays=b"\x01" * 24)
    assert len(later) > len(data) + 30 and decode(later) == decode(data)
    m = message_class(NEWER_FIELDS)()
    m.ParseFromString(later[6:])
    assert (m.novelty, m.minor) == ("future", 3)
    with pytest.raises(RecordError) as e:
        decode(edit_message(later, lambda m: setattr(m, "topk", record.topk + 1)))
    assert e.value.field == "topk_ids"


def test_a_newer_minor_version_of_schema_1_is_read_and_its_additions_skipped(record):
    """A writer of schema 1.3 added a header key, a key in `sampling` and an array after the 1.0 ones: this build
    reads the fields it knows, skips the rest, and still refuses a record whose declared tail does not add up."""
    data = records_v1.encode(record)
    assert decode(newer_writer_v1(data, b"\x01" * 24, minor=3, tail=24, novelty={"kind": "future"})) == decode(data)
    for extra, declared in ((b"\x01" * 24, 23), (b"", 8), (b"\x01" * 8, 0)):
        with pytest.raises(RecordError) as e:
            decode(newer_writer_v1(data, extra, minor=3, tail=declared))
        assert e.value.field == "payload"
    for key, value in (("minor", -1), ("minor", "3"), ("tail", -8)):
        with pytest.raises(RecordError) as e:
            decode(newer_writer_v1(data, **{key: value}))
        assert e.value.field == f"header.{key}"


def test_headers_say_what_a_message_is_and_foreign_ones_are_refused():
    check_headers(None)
    check_headers([])
    assert dict(kafka_headers()) == {"content-type": CONTENT_TYPE.encode(), "dvi-schema": f"2.{SCHEMA_MINOR}".encode()}
    check_headers(kafka_headers())
    check_headers([("dvi-schema", b"2.9"), ("other", b"x")])  # a newer minor version
    check_headers([("content-type", READS[1].encode()), ("dvi-schema", b"1.0")])  # written before schema 2
    for bad in ([("dvi-schema", b"3.0")], [("content-type", b"application/json")], [("dvi-schema", b"")]):
        with pytest.raises(RecordError) as e:
            check_headers(bad)
        assert e.value.field == "headers"
