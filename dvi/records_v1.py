"""DecisionRecord schema 1: the wire format of builds before schema 2, read so that records written before an
upgrade still train, and written only by `encode` (kept beside its reader so the reader stays tested against it).

    "DVIR" | u16 schema version (1) | u16 flags (0) | u32 payload length | zlib(payload)
    payload = u32 header length | header (JSON, metadata + counts) | arrays, little-endian, in order:
        prompt_ids [P], prefix_ids [F], generated_ids [G]      ids dtype (u16 if the vocabulary fits, else i32)
        rounds [R, 4] = (position, k, accepted, token)         i32
        drafted [sum k]                                        ids dtype
        topk_ids [sum (k + 1), topk]                           ids dtype
        topk_logprobs [sum (k + 1), topk]                      f16 or f32

Within schema 1 a writer could add header keys and arrays in a later minor version (header `minor`; `tail`: bytes
of arrays after the ones above); the reader takes the fields it knows and skips the rest. The compressed payload
is inflated no further than its declared size, itself bounded by the reader's `Limits`. The record objects and
validation are `dvi.records`, the current format `dvi.record_codec`, which calls this module; this one knows only
the old bytes and returns a record's parts, not a record.
"""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from dvi.errors import DviError, RecordError

VERSION = 1
MAGIC = b"DVIR"
PREFIX = struct.Struct("<4sHHI")  # magic, schema version, flags, uncompressed payload length
_U32 = struct.Struct("<I")
LP_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
_ID_DTYPES = {"<u2": np.dtype("<u2"), "<i4": np.dtype("<i4")}
_HEADER_KEYS = frozenset(
    ["record_id", "time", "replica_id", "request_id", "chunk_index", "final", "target", "drafter_version",
     "sampling", "domain", "topk", "counts", "ids", "logprobs"]
)


def encode(record, *, logprob_dtype: str = "float16", level: int = 6) -> bytes:
    """Serialize a valid `dvi.records.DecisionRecord` as a schema-1 writer did."""
    if logprob_dtype not in LP_DTYPES:
        raise DviError(f"logprob_dtype must be one of {sorted(LP_DTYPES)}, got {logprob_dtype!r}")
    ids_key = "<u2" if record.target.vocab_size <= 1 << 16 else "<i4"
    id_t = _ID_DTYPES[ids_key]
    rounds = record.rounds
    header = {
        "record_id": record.record_id,
        "time": record.time,
        "replica_id": record.replica_id,
        "request_id": record.request_id,
        "chunk_index": int(record.chunk_index),
        "final": record.final,
        "target": {"name": record.target.name, "vocab_size": int(record.target.vocab_size)},
        "drafter_version": record.drafter_version,
        "sampling": {
            "temperature": float(record.sampling.temperature),
            "top_p": float(record.sampling.top_p),
            "seed": None if record.sampling.seed is None else int(record.sampling.seed),
        },
        "domain": record.domain,
        "topk": int(record.topk),
        "counts": [len(record.prompt_ids), len(record.prefix_ids), len(record.generated_ids), len(rounds)],
        "ids": ids_key,
        "logprobs": logprob_dtype,
    }
    head = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    table = np.array([(r.position, r.k, r.accepted, r.token) for r in rounds], dtype="<i4").reshape(-1, 4)  # [R, 4]
    drafted = [d for r in rounds for d in r.drafted]
    parts = [
        _U32.pack(len(head)),
        head,
        np.asarray(record.prompt_ids, id_t).tobytes(),
        np.asarray(record.prefix_ids, id_t).tobytes(),
        np.asarray(record.generated_ids, id_t).tobytes(),
        table.tobytes(),
        np.asarray(drafted, id_t).tobytes(),
    ]
    if record.topk:
        parts.append(np.concatenate([r.topk_ids for r in rounds]).astype(id_t).tobytes())  # [sum(k+1), topk]
        parts.append(np.concatenate([r.topk_logprobs for r in rounds]).astype(LP_DTYPES[logprob_dtype]).tobytes())
    payload = b"".join(parts)
    return PREFIX.pack(MAGIC, VERSION, 0, len(payload)) + zlib.compress(payload, level)


def parse(data: bytes, limits=None, max_bytes: int | None = None) -> tuple:
    """The parts of the record in schema-1 bytes, in the order `dvi.record_codec.assemble` takes them (not yet validated);
    `RecordError` for anything else. The payload is inflated no further than the largest valid one within `limits`
    (a `dvi.record_codec.Limits`; without them, 64 x `max_bytes` or 64 MiB)."""
    if len(data) < PREFIX.size:
        raise RecordError("record", f"truncated: {len(data)} bytes, shorter than the {PREFIX.size}-byte prefix")
    magic, version, flags, size = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise RecordError("magic", f"not a schema-1 DecisionRecord (starts with {data[:4]!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise RecordError("schema_version", f"unknown schema version {version} in a {MAGIC!r} record (only 1 was written)")
    if flags != 0:
        raise RecordError("flags", f"unknown flags {flags:#x}")
    limit = limits.payload_bytes() if limits is not None else 64 * (max_bytes or 1 << 20)
    if size > limit:
        raise RecordError("payload", f"declared size {size} bytes exceeds the decompression bound {limit}")
    z = zlib.decompressobj()
    try:
        payload = z.decompress(data[PREFIX.size :], size + 1)
    except zlib.error as e:
        raise RecordError("payload", f"corrupt compressed data ({e})") from None
    if not z.eof:
        raise RecordError("payload", "truncated: the compressed data ends early" if len(payload) <= size else "longer than declared")
    if z.unused_data:
        raise RecordError("payload", f"{len(z.unused_data)} trailing bytes after the compressed data")
    if len(payload) != size:
        raise RecordError("payload", f"{len(payload)} bytes, the prefix declares {size}")
    return _parse_payload(payload, limits)


def _parse_payload(payload: bytes, limits) -> tuple:
    if len(payload) < 4:
        raise RecordError("header", "truncated")
    (hlen,) = _U32.unpack_from(payload)
    if 4 + hlen > len(payload):
        raise RecordError("header", f"length {hlen} runs past the payload")
    try:
        h = json.loads(payload[4 : 4 + hlen])
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RecordError("header", f"not JSON ({type(e).__name__})") from None
    if not isinstance(h, dict):
        raise RecordError("header", f"expected a JSON object, got {type(h).__name__}")
    if not _HEADER_KEYS <= set(h):  # keys of a newer minor version are ignored
        raise RecordError("header", f"keys of schema v1 missing: {sorted(_HEADER_KEYS - set(h))}")
    for key, keys in (("target", {"name", "vocab_size"}), ("sampling", {"temperature", "top_p", "seed"})):
        if not isinstance(h[key], dict) or not keys <= set(h[key]):
            raise RecordError(key, f"expected an object with keys {sorted(keys)}")
    _count(h.get("minor", 0), "header.minor")
    tail = _count(h.get("tail", 0), "header.tail")  # bytes of a newer minor version's arrays, skipped
    if h["ids"] not in _ID_DTYPES:
        raise RecordError("header.ids", f"unknown id dtype {h['ids']!r}")
    if h["logprobs"] not in LP_DTYPES:
        raise RecordError("header.logprobs", f"unknown log-prob dtype {h['logprobs']!r}")
    counts = h["counts"]
    if not (isinstance(counts, list) and len(counts) == 4 and all(type(c) is int and c >= 0 for c in counts)):
        raise RecordError("header.counts", f"expected 4 non-negative integers, got {counts!r}")
    topk = _count(h["topk"], "topk")
    id_t, lp_t = _ID_DTYPES[h["ids"]], LP_DTYPES[h["logprobs"]]
    n_prompt, n_prefix, n_gen, n_rounds = counts
    if limits is not None:  # before any array is read
        limits.check(topk, n_rounds, n_prompt + n_prefix + n_gen)

    buf = memoryview(payload)[4 + hlen :]
    pos = 0

    def take(n: int, dtype: np.dtype, name: str) -> np.ndarray:
        nonlocal pos
        nbytes = n * dtype.itemsize
        if pos + nbytes > len(buf):
            raise RecordError(name, f"truncated: needs {nbytes} bytes, {len(buf) - pos} left")
        a = np.frombuffer(buf, dtype, n, pos)
        pos += nbytes
        return a

    prompt = take(n_prompt, id_t, "prompt_ids")
    prefix = take(n_prefix, id_t, "prefix_ids")
    generated = take(n_gen, id_t, "generated_ids")
    table = take(4 * n_rounds, np.dtype("<i4"), "rounds").reshape(n_rounds, 4)  # [R, (position, k, accepted, token)]
    ks = table[:, 1].astype(np.int64)
    if (ks < 0).any():
        raise RecordError("rounds.k", "negative k")
    if limits is not None:
        limits.check_k(ks)
    drafted = take(int(ks.sum()), id_t, "drafted")
    rows = int((ks + 1).sum())
    if topk:
        t_ids = take(rows * topk, id_t, "topk_ids").reshape(rows, topk)  # [sum(k+1), topk]
        t_lps = take(rows * topk, lp_t, "topk_logprobs").reshape(rows, topk).astype(np.float32)
    else:
        t_ids = np.zeros((rows, 0), np.int32)
        t_lps = np.zeros((rows, 0), np.float32)
    if pos + tail != len(buf):
        raise RecordError("payload", f"{len(buf) - pos} bytes after the arrays, the header declares {tail}")
    s = h["sampling"]
    return (
        VERSION, h["record_id"], h["time"], h["replica_id"], h["request_id"], h["chunk_index"], h["final"],
        h["target"]["name"], h["target"]["vocab_size"], h["drafter_version"],
        s["temperature"], s["top_p"], s["seed"], h["domain"], topk, prompt, prefix, generated, table,
        drafted, t_ids, t_lps,
    )


def _count(v, name: str) -> int:
    if type(v) is not int:
        raise RecordError(name, f"expected an integer, got {type(v).__name__}")
    if v < 0:
        raise RecordError(name, f"expected >= 0, got {v}")
    return v
