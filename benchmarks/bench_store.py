"""The durable broker's store under a growing topic: resident memory of the S3 store (`streams.s3_store`) against the
number of record batches written to it (all of which it holds, unless a retention removes them).

One process starts the embedded broker with a data folder (Tansu on the local S3 store, as `stream.data_dir` runs
it), creates a topic of `--partitions` partitions, and produces `--batches` records one batch each (each send
waits for its acknowledgement, as the serving loop's small batches mostly arrive) of `--record-bytes` bytes, round
robin over the partitions, at most `--rate` a second, while a consumer group reads them back as they come (every
fetch makes Tansu list the partition's batches). Every `--sample-s` seconds it records the store's resident memory
(MiB, from /proc) and its parts by kind of mapping (`memory_kinds`: the main heap, the malloc arenas of other threads,
Python's object arenas, other anonymous memory, files), the batches written so far and the batches its folder
holds. Printed: the samples, and the store's growth per 1,000 batches written (least-squares slope over the second
half of the run, after the store's own start-up). With `--retention-s N` the
broker keeps the topic's batches N seconds (`stream.retention_hours`): the store then holds a bounded number.

The soak (`benchmarks.soak`) judges every process by its last hour; at its traffic the decision topic gains about
5,000 batches an hour, so `--batches 10000` stands for the two-hour run's topic, in minutes and alone.

What it does not know: Tansu's own memory (printed beside it, not judged), real decision records (these are random
bytes of the same size), several producers.

Run: .venv/bin/python -m benchmarks.bench_store [--batches 10000] [--rate 40] [--retention-s N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from benchmarks.soak import slope_per_min
from dvi.procs import free_port, rss_mib
from streams.broker import EmbeddedBroker, records_glob

TOPIC = "bench.store"
ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread's malloc arena starts at a multiple of it
PY_ARENA = 1 << 20  # CPython's object arena (3.10 and later), mapped one by one
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+ *(.*)$")


def memory_kinds(smaps: str) -> dict[str, float]:
    """Resident MiB of a process by kind of mapping, from its /proc/PID/smaps text: `heap` (the main malloc arena),
    `arenas` (other threads' malloc arenas: anonymous, starting at a multiple of ARENA_ALIGN; a large block mapped at
    such an address by chance would count too), `python` (anonymous
    mappings of exactly PY_ARENA: CPython's object arenas; a large block malloc mapped at that size would count here
    too), `anon` (every other anonymous mapping: large blocks malloc mapped, thread stacks), `files` (code and data
    mapped from files), `other` ([stack], [vdso] and the like)."""
    out = dict.fromkeys(("heap", "arenas", "python", "anon", "files", "other"), 0.0)
    kind = None
    for line in smaps.splitlines():
        if (m := _MAPPING.match(line)) is not None:
            start, end, name = int(m[1], 16), int(m[2], 16), m[4].strip()
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("["):
                kind = "other"
            elif name:
                kind = "files"
            elif start % ARENA_ALIGN == 0:
                kind = "arenas"
            elif end - start == PY_ARENA:
                kind = "python"
            else:
                kind = "anon"
        elif line.startswith("Rss:") and kind is not None:
            out[kind] += int(line.split()[1]) / 1024
    return {k: round(v, 2) for k, v in out.items()}


def store_kinds(pid: int) -> dict[str, float] | None:
    try:
        return memory_kinds(Path(f"/proc/{pid}/smaps").read_text())
    except OSError:
        return None


def growth_per_1000(samples: list[dict]) -> float | None:
    """MiB per 1,000 batches: the least-squares slope of RSS against batches written, over the second half of the
    samples (None with fewer than four there)."""
    half = samples[len(samples) // 2:]
    if len(half) < 4:
        return None
    # slope_per_min takes (seconds, value) pairs; batches / 1000 * 60 as "seconds" makes its per-minute slope per 1,000
    return slope_per_min([(s["batches"] * 60 / 1000, s["store_mib"]) for s in half])


def read_back(bootstrap: str, stop: threading.Event, counts: dict) -> None:
    consumer = KafkaConsumer(TOPIC, bootstrap_servers=bootstrap, group_id="bench-store", auto_offset_reset="earliest",
                             enable_auto_commit=True, fetch_max_wait_ms=200)
    try:
        while not stop.is_set():
            for records in consumer.poll(timeout_ms=500).values():
                counts["read"] += len(records)
    finally:
        consumer.close()


def run(args) -> dict:
    data = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    retain = (TOPIC, args.retention_s) if args.retention_s else None
    broker = EmbeddedBroker(free_port(), data_dir=data, retain=retain).start()
    stop, counts, samples = threading.Event(), {"read": 0}, []
    try:
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.create_topics([NewTopic(TOPIC, args.partitions, 1)])
        admin.close()
        reader = threading.Thread(target=read_back, args=(broker.bootstrap, stop, counts), daemon=True)
        reader.start()
        producer = KafkaProducer(bootstrap_servers=broker.bootstrap, acks="all", linger_ms=0)
        payload = os.urandom(args.record_bytes)
        start = last_sample = time.monotonic()
        for n in range(1, args.batches + 1):
            producer.send(TOPIC, payload, partition=n % args.partitions).get(timeout=60)
            now = time.monotonic()
            if now - last_sample >= args.sample_s or n == args.batches:
                last_sample = now
                held = len(list(data.glob(records_glob(TOPIC))))
                samples.append({"s": round(now - start, 1), "batches": n, "held": held, "read": counts["read"],
                                "store_mib": round(rss_mib(broker.store_pid), 1), "tansu_mib": round(rss_mib(broker.pid), 1),
                                "store_kinds": store_kinds(broker.store_pid)})
                print(json.dumps(samples[-1]), flush=True)
            if (ahead := n / args.rate - (time.monotonic() - start)) > 0:
                time.sleep(ahead)
        producer.close()
    finally:
        stop.set()
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)
    half = samples[len(samples) // 2:]
    return {"batches": args.batches, "partitions": args.partitions, "record_bytes": args.record_bytes,
            "retention_s": args.retention_s, "rate": args.rate,
            "seconds": samples[-1]["s"], "read": counts["read"],
            "store_mib": {"start": samples[0]["store_mib"], "half": half[0]["store_mib"], "end": samples[-1]["store_mib"],
                          "median_second_half": statistics.median(s["store_mib"] for s in half)},
            "store_mib_per_1000_batches": growth_per_1000(samples), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_store", description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=10000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--record-bytes", type=int, default=2700, dest="record_bytes")
    p.add_argument("--rate", type=float, default=40.0, help="batches a second at most")
    p.add_argument("--retention-s", type=float, dest="retention_s", help="keep the topic's batches this long (default: all)")
    p.add_argument("--sample-s", type=float, default=5.0, dest="sample_s")
    p.add_argument("--dir", help="where the broker's data folder is made (default: the system's temp folder)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)
    result = run(args)
    print(f"store: {result['store_mib']['start']} MiB at start, {result['store_mib']['half']} at half, "
          f"{result['store_mib']['end']} at the end ({args.batches} batches); "
          f"{result['store_mib_per_1000_batches']} MiB per 1,000 batches over the second half")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
