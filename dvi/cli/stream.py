"""`dvi broker` and `dvi stream tail`: thin entry points over `streams.broker` and `streams.consumer`.

`dvi broker` runs the embedded Tansu broker in the foreground on 127.0.0.1:stream.port (topics created) until
Ctrl-C or SIGTERM. `dvi stream tail` prints records from the decisions topic, one line each (or one JSON object
each with --json); it reads without a consumer group, commits nothing and dead-letters nothing. `dvi stream schema`
prints the record schema as `.proto` text, the form a schema registry takes (its id then goes in stream.schema_id).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dvi.cli import output
from dvi.cli.output import out
from dvi.config import load_config, overrides_of
from dvi.errors import DviError
from dvi.procs import run_foreground
from dvi.record_proto import proto_text
from dvi.records import Delivered
from streams.broker import EmbeddedBroker
from streams.client import quiet_kafka_logs
from streams.consumer import DecisionConsumer
from streams.topics import ensure_topics, stream_topics


def broker(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args)).stream
    quiet_kafka_logs(args.verbose)
    if not cfg.embedded:
        raise DviError(
            f"stream.bootstrap_servers is set ({cfg.bootstrap_servers}): the stream uses that Kafka, not an embedded "
            "broker; run `dvi broker stream.bootstrap_servers=null` for a local one"
        )

    def ready(server: EmbeddedBroker) -> str:
        ensure_topics(cfg)
        topics = ", ".join(f"{t} ({n})" for t, n in stream_topics(cfg).items())
        kept = f", {cfg.topic} kept {cfg.retention_hours:g} h" if cfg.retention_hours is not None else ""
        storage = (f"{cfg.data_dir} (durable{kept})" if cfg.data_dir else cfg.storage_engine) or "memory (lost on stop)"
        return f"Tansu on {server.bootstrap}, storage {storage}, topics {topics}"

    return run_foreground("broker", "the broker", EmbeddedBroker(cfg.port, cfg.storage_engine, data_dir=cfg.data_dir,
                                                                      retain=cfg.retain), ready, say=out)


def summary(d: Delivered) -> str:
    """One readable line for a delivered record."""
    r = d.record
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(r.time))
    rate = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
    return (
        f"{stamp} p{d.partition}@{d.offset} request={r.request_id} chunk={r.chunk_index}{'' if r.final else '+'} "
        f"replica={r.replica_id} target={r.target.name} drafter={r.drafter_version or '-'} "
        f"prompt={len(r.prompt_ids)} generated={len(r.generated_ids)} rounds={len(r.rounds)} "
        f"drafted={r.drafted} accepted={r.accepted} ({rate}) topk={r.topk} T={r.sampling.temperature:g}"
        + (f" domain={r.domain}" if r.domain else "")
    )


def schema(args: argparse.Namespace) -> int:
    out(proto_text(), end="")
    return 0


def tail(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args)).stream
    quiet_kafka_logs(args.verbose)
    if args.max is not None and args.max < 1:
        raise DviError(f"--max must be >= 1, got {args.max}")
    if args.timeout is not None and args.timeout <= 0:
        raise DviError(f"--timeout must be > 0 seconds, got {args.timeout}")
    shown = 0
    with DecisionConsumer(cfg, group_id=None, from_beginning=args.from_beginning, dead_letter=False, client_id="dvi-tail") as c:
        last = time.monotonic()
        try:
            while args.max is None or shown < args.max:
                if args.timeout is not None and time.monotonic() - last >= args.timeout:
                    break
                wait = 0.5 if args.timeout is None else max(0.05, min(0.5, args.timeout - (time.monotonic() - last)))
                got = c.poll(wait, max_records=(args.max - shown) if args.max else 500)
                if got:
                    last = time.monotonic()
                for d in got:
                    if args.json:
                        out(json.dumps({**d.record.to_dict(), "kafka": {"topic": d.topic, "partition": d.partition, "offset": d.offset}}))
                    else:
                        out(summary(d))
                    shown += 1
                output.stream().flush()
        except KeyboardInterrupt:
            pass
        except BrokenPipeError:  # the reader went away (`| head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), output.stream().fileno())
        invalid = c.stats.invalid
    if invalid:
        print(f"dvi stream tail: {invalid} invalid record(s) skipped", file=sys.stderr)
    return 0
