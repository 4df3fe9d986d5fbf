"""The DecisionRecord's wire format, one function each way (`encode` / `decode`), never pickle.

A record (`dvi.records.DecisionRecord`) travels as a protobuf message (`dvi.record_proto`, the schema as `.proto`
text from `dvi stream schema`) in Confluent's framing, so a schema-registry-aware tool reads it:

    0x00 | u32 schema id (big-endian; a registry's id for the schema, 0: none) | message indexes [0] (the file's
    first message, DecisionRecord; written as one 0 byte, read in either of Confluent's forms) | protobuf DecisionRecord

Token ids and the teacher arrays are packed little-endian `bytes` fields (ids u16 if the vocabulary fits, else i32;
log-probs f16 or f32), the width declared beside them. There is one compression layer, Kafka's batch compression
(`stream.compression`); a record itself is not compressed.

Evolution: the schema's major version is its package (`dvi.records.v2`); a minor version only adds fields with new
numbers (`minor` says which the writer knew), and a reader skips fields it does not know. On Kafka a record
carries headers (`kafka_headers`) saying its content type and schema version, so tools can route it without
opening it. This build also reads schema 1 (`dvi.records_v1`: a JSON header and zlib-compressed arrays), so
records written before an upgrade still train. A reader's `Limits` bound what it reads before any array is.

`encode` validates on the writing side and `decode` on the reading side (`dvi.records.validate`); failures raise
`RecordError` naming the field. This module knows the bytes, the schema and numpy; the record objects and their
validity are `dvi.records`, and it knows nothing about Kafka beyond a message's headers, nor topics or where
records go.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from dvi import records_v1
from dvi.errors import DviError, RecordError
from dvi.features import ENCODINGS, Features
from dvi.record_proto import RECORD, message_class
from dvi.records import (CONTENT_TYPE, FEATURE_DTYPES, MAX_LAYERS, READS, SCHEMA_VERSION, DecisionRecord, RoundRecord, Sampling,
                         Target, validate)

SCHEMA_MINOR = 1  # the minor version this build writes (1: features); it reads records of any minor version
_FRAME = struct.Struct(">BI")  # Confluent's framing: magic byte 0, schema id; then the message indexes ([0]: one 0 byte)
LP_DTYPES = records_v1.LP_DTYPES  # the log-prob element types a record may carry
_IDS_OF_WIDTH = {2: np.dtype("<u2"), 4: np.dtype("<i4")}  # id_bytes -> the ids' element type
_LOGPROBS_OF_WIDTH = {t.itemsize: t for t in LP_DTYPES.values()}  # logprob_bytes -> the log-probs' element type
MAX_METADATA = 64 << 10  # bytes of a record's fields other than its arrays, generously


def kafka_headers() -> list[tuple[str, bytes]]:
    """The Kafka headers of a record this build writes: its content type and schema version."""
    return [("content-type", CONTENT_TYPE.encode()), ("dvi-schema", f"{SCHEMA_VERSION}.{SCHEMA_MINOR}".encode())]


def check_headers(headers: Any) -> None:
    """Refuse (RecordError "headers") a Kafka message whose headers say it is not a record this build reads: another
    content type or a major schema version it does not know. Messages without those headers are judged by their bytes."""
    found = {k: v for k, v in (headers or []) if isinstance(k, str) and isinstance(v, (bytes, bytearray))}
    kind = found.get("content-type")
    if kind is not None and bytes(kind).decode(errors="replace") not in READS.values():
        raise RecordError("headers", f"content type {bytes(kind)[:80]!r}, not {CONTENT_TYPE} (or v1's {READS[1]})")
    schema = found.get("dvi-schema")
    if schema is not None and bytes(schema).split(b".")[0] not in {str(v).encode() for v in READS}:
        raise RecordError("headers", f"schema {bytes(schema)[:20]!r}, this build reads {' and '.join(f'{v}.x' for v in READS)}")


def encode(record: DecisionRecord, *, logprob_dtype: str = "float16", max_bytes: int | None = None, schema_id: int = 0) -> bytes:
    """Validate and serialize a record (see the module docstring); `max_bytes` bounds the result; `schema_id`: the
    id a schema registry gave the v2 schema (0: none), written in the framing."""
    validate(record)
    if logprob_dtype not in LP_DTYPES:
        raise DviError(f"logprob_dtype must be one of {sorted(LP_DTYPES)}, got {logprob_dtype!r}")
    if isinstance(schema_id, bool) or not isinstance(schema_id, int) or not 0 <= schema_id < 1 << 31:
        raise DviError(f"schema_id must be an integer in [0, 2^31), got {schema_id!r}")
    id_t = _IDS_OF_WIDTH[2 if record.target.vocab_size <= 1 << 16 else 4]
    lp_t = LP_DTYPES[logprob_dtype]
    rounds = record.rounds
    table = np.array([(r.position, r.k, r.accepted, r.token) for r in rounds], dtype="<i4").reshape(-1, 4)  # [R, 4]
    m = message_class()(
        record_id=record.record_id, time=record.time, replica_id=record.replica_id, request_id=record.request_id,
        chunk_index=int(record.chunk_index), final=record.final, topk=int(record.topk),
        id_bytes=id_t.itemsize, logprob_bytes=lp_t.itemsize,
        prompt_ids=np.asarray(record.prompt_ids, id_t).tobytes(),
        prefix_ids=np.asarray(record.prefix_ids, id_t).tobytes(),
        generated_ids=np.asarray(record.generated_ids, id_t).tobytes(),
        rounds=table.tobytes(),
        drafted=np.asarray([d for r in rounds for d in r.drafted], id_t).tobytes(),
        minor=SCHEMA_MINOR,
    )
    m.target.name, m.target.vocab_size = record.target.name, int(record.target.vocab_size)
    m.sampling.temperature, m.sampling.top_p = float(record.sampling.temperature), float(record.sampling.top_p)
    if record.sampling.seed is not None:
        m.sampling.seed = int(record.sampling.seed)
    if record.drafter_version is not None:
        m.drafter_version = record.drafter_version
    if record.domain is not None:
        m.domain = record.domain
    if record.topk:
        m.topk_ids = np.concatenate([r.topk_ids for r in rounds]).astype(id_t).tobytes()  # [sum(k+1), topk]
        m.topk_logprobs = np.concatenate([r.topk_logprobs for r in rounds]).astype(lp_t).tobytes()
    head = _FRAME.pack(0, schema_id) + b"\x00"
    features = record.features
    if features is not None and max_bytes is not None:  # the oldest rows go first where the bound would not hold them
        room = max_bytes - len(head) - m.ByteSize() - 64 - 4 * len(features.layers)
        fits = room // features.row_bytes if room > 0 else 0
        features = features.last(min(features.rows, fits))
    if features is not None:
        m.features_width, m.features_start = features.width, features.start
        m.features_layers.extend(features.layers)
        m.features_encoding = features.encoding
        m.features = features.data.astype(FEATURE_DTYPES[features.encoding]).tobytes()
        if features.scales is not None:
            m.features_scales = features.scales.astype("<f4").tobytes()
    data = head + m.SerializeToString()
    if max_bytes is not None and len(data) > max_bytes:
        raise RecordError("record", f"encoded size {len(data)} bytes exceeds the bound of {max_bytes} (stream.max_record_bytes)")
    return data


@dataclass(frozen=True)
class Limits:
    """What a reader accepts beyond validity: the teacher width it trains with and the sizes its writers make
    (`stream.topk`, `stream.chunk_rounds`, `serve.spec.k_max`, prompt plus generated tokens). They bound the
    largest valid record, so `decode` never reads (or, for v1, decompresses) much more than that."""

    topk: int
    max_rounds: int
    max_k: int
    max_tokens: int = 1 << 15
    max_feature_bytes: int = 0  # the features a record may carry (stream.max_record_bytes where they are on)

    def payload_bytes(self) -> int:
        """The largest payload a valid record within these limits has (metadata, ids as i32, log-probs as f32,
        features)."""
        per_round = 16 + 4 * self.max_k + (self.max_k + 1) * self.topk * 8  # the table row, drafts, teacher rows
        return MAX_METADATA + 4 * self.max_tokens + self.max_rounds * per_round + self.max_feature_bytes

    def check(self, topk: int, n_rounds: int, n_tokens: int) -> None:
        """Refuse a record's counts beyond these limits, before any of its arrays is read."""
        if topk != self.topk:
            raise RecordError("topk", f"teacher width {topk}, this reader takes {self.topk} (stream.topk)")
        if n_rounds > self.max_rounds:
            raise RecordError("rounds", f"{n_rounds} rounds, more than the {self.max_rounds} of a chunk (stream.chunk_rounds)")
        if n_tokens > self.max_tokens:
            raise RecordError("counts", f"{n_tokens} tokens, more than {self.max_tokens}")

    def check_k(self, ks: np.ndarray) -> None:
        if ks.size and int(ks.max()) > self.max_k:
            raise RecordError("rounds.k", f"k = {int(ks.max())}, more than serve.spec.k_max = {self.max_k}")


def decode(data: bytes, vocab_size: int | None = None, *, max_bytes: int | None = None,
           limits: Limits | None = None) -> DecisionRecord:
    """Parse and validate bytes made by `encode` (or by a v1 writer); anything else raises `RecordError`. With
    `limits`, a record beyond them is refused too, before its arrays are read."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RecordError("record", f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if max_bytes is not None and len(data) > max_bytes:
        raise RecordError("record", f"{len(data)} bytes exceeds the bound of {max_bytes} (stream.max_record_bytes)")
    if data[:1] == b"\x00":
        record = _parse(data, limits)
    elif data[:4] == records_v1.MAGIC:
        record = assemble(*records_v1.parse(data, limits, max_bytes))
    else:
        raise RecordError("magic", f"not a DecisionRecord (starts with {data[:5]!r}: neither the framing byte 0 nor v1's b'DVIR')")
    validate(record, vocab_size)
    return record


def _parse(data: bytes, limits: Limits | None) -> DecisionRecord:
    start = _payload_start(data)
    if limits is not None and len(data) > start + limits.payload_bytes():
        raise RecordError("record", f"{len(data)} bytes, more than the largest valid record ({limits.payload_bytes()})")
    m = message_class()()
    try:
        m.ParseFromString(data[start:])
    except DecodeError as e:
        raise RecordError("payload", f"truncated or corrupt: not a protobuf {RECORD} ({e})") from None
    for key in ("target", "sampling"):
        if not m.HasField(key):
            raise RecordError(key, "missing")
    id_t = _IDS_OF_WIDTH.get(m.id_bytes)
    lp_t = _LOGPROBS_OF_WIDTH.get(m.logprob_bytes)
    if id_t is None:
        raise RecordError("id_bytes", f"{m.id_bytes}, expected 2 (uint16) or 4 (int32)")
    if lp_t is None:
        raise RecordError("logprob_bytes", f"{m.logprob_bytes}, expected 2 (float16) or 4 (float32)")

    def array(name: str, dtype: np.dtype, n: int | None = None) -> np.ndarray:
        raw = getattr(m, name)
        if len(raw) % dtype.itemsize or (n is not None and len(raw) != n * dtype.itemsize):
            want = f"{n} x {dtype.itemsize}" if n is not None else f"a multiple of {dtype.itemsize}"
            raise RecordError(name, f"{len(raw)} bytes, expected {want}")
        return np.frombuffer(raw, dtype)

    topk = int(m.topk)
    n_rounds, rem = divmod(len(m.rounds), 16)
    if rem:
        raise RecordError("rounds", f"{len(m.rounds)} bytes, not a multiple of 16 (4 int32 per round)")
    n_tokens = sum(len(getattr(m, f)) // id_t.itemsize for f in ("prompt_ids", "prefix_ids", "generated_ids"))
    if limits is not None:
        limits.check(topk, n_rounds, n_tokens)
    table = array("rounds", np.dtype("<i4")).reshape(n_rounds, 4)  # [R, (position, k, accepted, token)]
    ks = table[:, 1].astype(np.int64)
    if (ks < 0).any():
        raise RecordError("rounds.k", "negative k")
    if limits is not None:
        limits.check_k(ks)
    rows = int((ks + 1).sum())
    s = m.sampling
    features = _parsed_features(m, limits)
    return assemble(
        SCHEMA_VERSION, m.record_id, m.time, m.replica_id, m.request_id, m.chunk_index, m.final, m.target.name, m.target.vocab_size,
        m.drafter_version if m.HasField("drafter_version") else None,
        s.temperature, s.top_p, s.seed if s.HasField("seed") else None,
        m.domain if m.HasField("domain") else None,
        topk, array("prompt_ids", id_t), array("prefix_ids", id_t), array("generated_ids", id_t), table,
        array("drafted", id_t, int(ks.sum())),
        array("topk_ids", id_t, rows * topk).reshape(rows, topk),
        array("topk_logprobs", lp_t, rows * topk).reshape(rows, topk).astype(np.float32),
        features=features,
    )


def _parsed_features(m, limits: Limits | None) -> Features | None:
    """The features of a parsed message (schema 2.1), shaped but not yet validated; None when it carries none."""
    width = int(m.features_width)
    if not width:
        return None
    if limits is not None and len(m.features) > limits.max_feature_bytes:
        raise RecordError("features", f"{len(m.features)} bytes of features, more than this reader takes ({limits.max_feature_bytes})")
    dtype = FEATURE_DTYPES.get(m.features_encoding)
    if dtype is None:
        raise RecordError("features_encoding", f"{m.features_encoding[:20]!r}, expected one of {', '.join(ENCODINGS)}")
    layers = tuple(int(i) for i in m.features_layers)
    if not layers or len(layers) > MAX_LAYERS:
        raise RecordError("features_layers", f"{len(layers)} layers, expected 1 to {MAX_LAYERS}")
    if len(m.features) % (width * dtype.itemsize):
        raise RecordError("features", f"{len(m.features)} bytes, not whole rows of {width} x {dtype.itemsize}")
    rows = len(m.features) // (width * dtype.itemsize)
    data = np.frombuffer(m.features, dtype).reshape(rows, width)
    scales = None
    if m.features_scales:
        if len(m.features_scales) != rows * len(layers) * 4:
            raise RecordError("features_scales", f"{len(m.features_scales)} bytes for {rows} rows of {len(layers)} layers")
        scales = np.frombuffer(m.features_scales, "<f4").reshape(rows, len(layers)).astype(np.float32)
    return Features(layers, int(m.features_start), m.features_encoding, data.astype(dtype.newbyteorder("=")), scales)


def _payload_start(data: bytes) -> int:
    """Where the protobuf message starts after the framing, whose message indexes must say [0] (DecisionRecord):
    Confluent writes [0] as one 0 byte, or as the zigzag-varint array it is (count 1, index 0)."""
    pos = _FRAME.size
    if len(data) <= pos:
        raise RecordError("record", f"truncated: {len(data)} bytes, shorter than the {pos + 1}-byte framing")
    count, pos = _zigzag(data, pos)
    if count == 0:
        return pos
    if not 0 < count <= 8:
        raise RecordError("framing", f"{count} message indexes, expected [0] (the schema's first message, {RECORD})")
    indexes = []
    for _ in range(count):
        index, pos = _zigzag(data, pos)
        indexes.append(index)
    if indexes != [0]:
        raise RecordError("framing", f"message indexes {indexes}, expected [0] (the schema's first message, {RECORD})")
    return pos


def _zigzag(data: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint at `pos` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise RecordError("framing", "truncated or overlong varint in the message indexes")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return (value >> 1) ^ -(value & 1), pos


def assemble(schema_version: int, record_id, time_s, replica_id, request_id, chunk_index, final, target_name, vocab_size,
             drafter_version, temperature, top_p, seed, domain, topk: int, prompt: np.ndarray, prefix: np.ndarray,
             generated: np.ndarray, table: np.ndarray, drafted: np.ndarray, t_ids: np.ndarray, t_lps: np.ndarray,
             features: Features | None = None) -> DecisionRecord:
    """A record from its parsed fields and arrays (`table` [R, 4], `drafted` [sum k], teacher rows [sum (k + 1), topk]);
    not yet validated. The fields come in the order `records_v1.parse` returns them."""
    rounds = []
    d0 = r0 = 0
    for position, k, accepted, token in table.tolist():
        rounds.append(
            RoundRecord(position, k, drafted[d0 : d0 + k].tolist(), accepted, token, t_ids[r0 : r0 + k + 1], t_lps[r0 : r0 + k + 1])
        )
        d0 += k
        r0 += k + 1
    return DecisionRecord(
        request_id=request_id, replica_id=replica_id, chunk_index=chunk_index, final=final,
        target=Target(target_name, vocab_size), drafter_version=drafter_version, sampling=Sampling(temperature, top_p, seed),
        prompt_ids=prompt.tolist(), prefix_ids=prefix.tolist(), generated_ids=generated.tolist(), rounds=rounds, topk=topk,
        domain=domain, record_id=record_id, time=time_s, schema_version=schema_version, features=features,
    )
