"""Decision-stream benchmark: record sizes, producer and consumer throughput, and what logging costs decoding.

One process, one run, against the real embedded Tansu broker (started here on a free port, or --bootstrap):

1. Record size in bytes per generated token (`dvi.record_codec.encode`; also after Kafka's gzip batch compression, and
   as schema 1 wrote them, zlib per record): for the demo pair's real records (an
   engine `Result` per prompt, greedy, the default adaptive K, chunked every `stream.chunk_rounds` rounds, carrying
   the target's features of the demo EAGLE-3 drafter's layers as `stream.features` has them: bf16, and int8, and
   without), and for synthetic records with the demo shapes and every round drafting K = 4 (the size a trained
   drafter's records approach), each with top-8 log-probs in float16, in float32, and without teacher signal
   (topk = 0).
2. Producer records/s: `DecisionProducer.submit` of N records as fast as possible until all are acknowledged
   (queue large enough that nothing drops), with Kafka gzip batch compression and without; and a consumer's
   records/s reading them back (`DecisionConsumer.poll`: fetch, decode, validate). Records are the demo
   pair's real ones (fresh record ids), or synthetic K = 4 ones with --synthetic.
3. Decode throughput with logging on vs off: the engine on the demo pair, the same prompts, interleaved
   (on/off order alternates per repeat), tokens/s per call, medians. The logging path is what the serving loop
   does: `records_from_result` + `producer.submit` after each generate call, inside the timed region, with the
   producer's background thread encoding and sending concurrently. Also the logging time on the decode
   thread itself as a share of the call's time (the precise part of the cost; the end-to-end difference
   includes the background thread competing for the 2 cores and is within noise at this size). On a shared
   machine read the paired ratio: on / off tokens/s of the same prompt decoded back to back, median.

What it does not know: other brokers (a real Kafka cluster's throughput and latency), several producers or
partitions under load, confluent-kafka (about 20x faster at producing), sampled decoding, batches > 1.
Timings are noisy on a shared 2-core machine: read them with the load noted next to the table.

Run: .venv/bin/python benchmarks/bench_stream.py [--quick] [--synthetic] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
import uuid

import numpy as np
import torch
import transformers
from kafka.codec import gzip_encode

from dvi.config import StreamConfig, load_config
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.features import Features
from dvi.models import encode_prompt
from dvi.pairs import resolve_pair
from dvi.procs import free_port
from dvi import records_v1
from dvi.record_codec import encode
from dvi.records import DecisionRecord, RoundRecord, Sampling, Target, records_from_result
from streams.broker import EmbeddedBroker
from streams.consumer import DecisionConsumer
from streams.producer import DecisionProducer
from streams.topics import ensure_topics

PROMPTS = [
    "Explain what a hash table is and when you would use one.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for writing clear technical documentation.",
    "What is the difference between a process and a thread?",
]
VOCAB, K, TOPK = 49152, 4, 8


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def synthetic_record(rng: np.random.Generator, rounds: int = 32, prompt_len: int = 40) -> DecisionRecord:
    """A consistent record with the demo shapes: vocab 49152, every round drafting K = 4, top-8 teacher."""
    generated, rrs = [], []
    for _ in range(rounds):
        drafted = rng.integers(0, VOCAB, K).tolist()
        acc = int(rng.integers(0, K + 1))
        token = int(rng.integers(0, VOCAB))
        ids = rng.integers(0, VOCAB, (K + 1, TOPK)).astype(np.int32)
        lps = -np.sort(rng.exponential(2.0, (K + 1, TOPK))).astype(np.float32)  # [K + 1, topk], descending
        rrs.append(RoundRecord(len(generated), K, drafted, acc, token, ids, lps))
        generated += drafted[:acc] + [token]
    return DecisionRecord(
        request_id=uuid.uuid4().hex, replica_id="bench", chunk_index=0, final=True, target=Target("synthetic", VOCAB),
        drafter_version="bench", sampling=Sampling(0.0), prompt_ids=rng.integers(0, VOCAB, prompt_len).tolist(),
        prefix_ids=[], generated_ids=generated, rounds=rrs, topk=TOPK,
    )


def without_teacher(r: DecisionRecord) -> DecisionRecord:
    rounds = [dataclasses.replace(x, topk_ids=x.topk_ids[:, :0], topk_logprobs=x.topk_logprobs[:, :0]) for x in r.rounds]
    return dataclasses.replace(r, rounds=rounds, topk=0)


def size_rows(name: str, records: list[DecisionRecord]) -> list[dict]:
    """Bytes per generated token of the same records: as encoded (schema 2, no compression of its own); after
    Kafka's gzip (kafka-python's codec, level 9) of each record alone (a batch of one: the most a batch costs) and of
    all of them in one batch; and as schema 1 wrote them (zlib per record), the figure schema 2 must not exceed."""
    tokens = sum(len(r.generated_ids) for r in records)
    rows = []
    variants = [("top-8 float16", records, "float16"), ("top-8 float32", records, "float32"),
                ("no teacher (topk 0)", [without_teacher(r) for r in records], "float16")]
    if any(r.features is not None for r in records):  # the same with their features in the other encoding, and without
        mine = records[0].features.encoding
        other = "bf16" if mine == "int8" else "int8"
        variants = [(f"top-8 float16, features {mine}", records, "float16"),
                    (f"top-8 float16, features {other}", [with_encoding(r, other) for r in records], "float16"),
                    ("top-8 float16, no features", [dataclasses.replace(r, features=None) for r in records], "float16")]
    for label, recs, dtype in variants:
        data = [encode(r, logprob_dtype=dtype) for r in recs]
        sizes = [len(d) for d in data]
        alone = sum(len(gzip_encode(d)) for d in data)
        rows.append({"records": name, "teacher": label, "n": len(recs), "tokens": tokens,
                     "bytes/record": statistics.median(sizes), "bytes/token": sum(sizes) / tokens,
                     "gzip alone B/token": alone / tokens, "gzip batch B/token": len(gzip_encode(b"".join(data))) / tokens,
                     "schema 1 B/token": sum(len(records_v1.encode(r, logprob_dtype=dtype)) for r in recs) / tokens,
                     "drafted/token": sum(r.drafted for r in recs) / tokens})
    return rows


def with_encoding(record: DecisionRecord, encoding: str) -> DecisionRecord:
    f = record.features
    return dataclasses.replace(record, features=None if f is None else Features.encode(f.tensor(), f.layers, f.start, encoding))


def fresh(records: list[DecisionRecord], n: int) -> list[DecisionRecord]:
    return [dataclasses.replace(records[i % len(records)], record_id=uuid.uuid4().hex) for i in range(n)]


def throughput(cfg: StreamConfig, records: list[DecisionRecord], compression: str) -> dict:
    topic = f"bench.{uuid.uuid4().hex[:8]}"
    cfg = dataclasses.replace(cfg, topic=topic, dlq_topic=topic + ".dlq", control_topic=topic + ".control",
                              compression=compression, queue_size=len(records) + 1)
    ensure_topics(cfg)
    size = sum(len(encode(r)) for r in records[:50]) / min(50, len(records))
    with DecisionProducer(cfg) as producer:
        producer.submit(records[0])  # connect first: time the steady state
        producer.flush(30)
        t0 = time.perf_counter()
        submit_max = 0.0
        for r in records[1:]:
            s = time.perf_counter()
            producer.submit(r)
            submit_max = max(submit_max, time.perf_counter() - s)
        submit_s = time.perf_counter() - t0
        producer.flush(300)
        produce_s = time.perf_counter() - t0
        stats = producer.stats
        kafka = producer.client_metrics()
    n = len(records) - 1
    with DecisionConsumer(cfg, group_id=None) as consumer:
        consumer.poll_until(1, 30)  # the first fetch (connection, metadata)
        t0 = time.perf_counter()
        got = len(consumer.poll_until(n, 300))
        consume_s = time.perf_counter() - t0
    return {"compression": compression, "records": n, "bytes/record": size,
            # the Kafka client's compressed / uncompressed batch size (1: batch compression saved nothing)
            "batch ratio": kafka.get("compression-rate-avg", float("nan")) if compression != "none" else 1.0,
            "sent": stats.sent - 1, "dropped": stats.dropped,
            "submit us": 1e6 * submit_s / n, "submit max ms": 1e3 * submit_max,
            "producer rec/s": n / produce_s, "producer MB/s": n * size / produce_s / 1e6,
            "consumer rec/s": got / consume_s, "consumed": got}


def decode_on_off(cfg, pair, prompts: list[list[int]], repeats: int, max_new: int) -> dict:
    engine = SpeculativeEngine(pair.target, pair.drafter, cfg.serve.spec, stop_ids={pair.tokenizer.eos_token_id})
    producer = DecisionProducer(cfg.stream)
    rates = {"off": [], "on": []}
    paired = []  # on / off tokens/s of the same prompt decoded back to back: robust to slow load drift
    log_share = []
    tokens = {"off": 0, "on": 0}
    with torch.inference_mode():
        engine.generate([Request(prompts[0], max_new_tokens=8)])  # warm-up
        for rep in range(repeats):
            order = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for prompt in prompts:
                pair_rate = {}
                for mode in order:
                    req = Request(prompt, max_new_tokens=max_new)
                    t0 = time.perf_counter()
                    result = engine.generate([req])[0]
                    t1 = time.perf_counter()
                    if mode == "on":
                        for rec in records_from_result(result, replica_id="bench", target_name=pair.target_dir.name,
                                                       vocab_size=engine.vocab_size, sampling=req, **cfg.stream.record_args):
                            producer.submit(rec)
                        log_share.append((time.perf_counter() - t1) / (time.perf_counter() - t0))
                    pair_rate[mode] = len(result.token_ids) / (time.perf_counter() - t0)
                    rates[mode].append(pair_rate[mode])
                    tokens[mode] += len(result.token_ids)
                paired.append(pair_rate["on"] / pair_rate["off"])
            log(f"  repeat {rep + 1}/{repeats}: off {statistics.median(rates['off']):.2f} tok/s, on {statistics.median(rates['on']):.2f} tok/s")
    stats = producer.close(30)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"calls per mode": len(rates["on"]), "tokens off": tokens["off"], "tokens on": tokens["on"],
            "tok/s off (median)": off, "tok/s on (median)": on, "on/off - 1": on / off - 1,
            "paired on/off - 1 (median)": statistics.median(paired) - 1,
            "logging share of call (median)": statistics.median(log_share), "logging share (max)": max(log_share),
            "records sent": stats.sent, "records dropped": stats.dropped}


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4f}" if abs(v) < 1 else f"{v:,.1f}"
        return str(v)

    cells = [[fmt(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |", "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer records and repeats")
    ap.add_argument("--synthetic", action="store_true", help="skip the demo pair: synthetic K=4 records only, no decode rows")
    ap.add_argument("--bootstrap", help="an existing Kafka instead of the embedded broker")
    ap.add_argument("--records", type=int, help="records for the throughput rows (default 3000, quick 1000)")
    ap.add_argument("--repeats", type=int, help="decode repeats per mode and prompt (default 5, quick 2)")
    ap.add_argument("--max-new-tokens", type=int, default=48, dest="max_new")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for decoding (0: torch's default)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/ (e.g. stream.features.share=0)")
    args = ap.parse_args()
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    n_records = args.records or (1000 if args.quick else 3000)
    repeats = args.repeats or (2 if args.quick else 5)

    load0 = os.getloadavg()
    broker = None if args.bootstrap else EmbeddedBroker(free_port()).start()
    bootstrap = args.bootstrap or broker.bootstrap
    cfg = load_config([f"stream.bootstrap_servers={bootstrap}", f"model.threads={args.threads}", *args.overrides])
    results: dict = {"bootstrap": bootstrap, "load_before": load0}
    try:
        rng = np.random.default_rng(0)
        synth = [synthetic_record(rng) for _ in range(200)]
        sizes = size_rows("synthetic K=4 (32 rounds)", synth)

        pair, real, prompts = None, [], []
        if not args.synthetic:
            transformers.utils.logging.disable_progress_bar()
            log("loading the demo pair ...")
            pair = resolve_pair(cfg.model)
            prompts = [encode_prompt(pair.tokenizer, p, raw=False) for p in PROMPTS]
            engine = SpeculativeEngine(pair.target, pair.drafter, cfg.serve.spec, stop_ids={pair.tokenizer.eos_token_id})
            log("decoding the prompts once for real records ...")
            with torch.inference_mode():
                for req, res in zip((reqs := [Request(p, max_new_tokens=args.max_new) for p in prompts]), engine.generate(reqs)):
                    real += records_from_result(res, replica_id="bench", target_name=pair.target_dir.name, vocab_size=engine.vocab_size,
                                                sampling=req, **cfg.stream.record_args)
            sizes = size_rows(f"demo pair, {len(prompts)} prompts x {args.max_new} tok", real) + sizes
        results["sizes"] = sizes

        source = synth if (args.synthetic or not real) else real
        log(f"throughput with {n_records} {'synthetic' if source is synth else 'demo-pair'} records ...")
        results["throughput"] = [throughput(cfg.stream, fresh(source, n_records + 1), c) for c in ("gzip", "none")]

        if pair is not None:
            log(f"decode throughput, logging on vs off ({repeats} repeats x {len(prompts)} prompts, {args.max_new} tokens) ...")
            results["decode"] = decode_on_off(cfg, pair, prompts, repeats, args.max_new)
    finally:
        if broker is not None:
            broker.stop()
    results["load_after"] = os.getloadavg()

    print(f"\nRecord size (dvi.record_codec.encode, schema 2; {'demo pair and ' if real else ''}synthetic records)")
    print(table(results["sizes"], ["records", "teacher", "n", "tokens", "drafted/token", "bytes/record", "bytes/token",
                                   "gzip alone B/token", "gzip batch B/token", "schema 1 B/token"]))
    print(f"\nProducer / consumer throughput (kafka-python 3.0.12, Tansu at {bootstrap}, one partition per request key)")
    print(table(results["throughput"], ["compression", "records", "bytes/record", "batch ratio", "sent", "dropped", "submit us", "submit max ms",
                                        "producer rec/s", "producer MB/s", "consumer rec/s"]))
    if "decode" in results:
        d = results["decode"]
        print("\nDecode throughput, logging on vs off (demo pair, greedy, adaptive K, interleaved; medians)")
        print(table([d], ["calls per mode", "tok/s off (median)", "tok/s on (median)", "on/off - 1", "paired on/off - 1 (median)",
                          "logging share of call (median)", "logging share (max)", "records sent", "records dropped"]))
    print(f"\nload average before {load0[0]:.2f}, after {results['load_after'][0]:.2f} (2 cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
