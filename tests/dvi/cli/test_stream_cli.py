"""`dvi broker`, `dvi stream tail` and `dvi generate --log` as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, KafkaProducer

from dvi.procs import REGISTRY_ENV, free_port, stop_leftovers
from dvi.record_codec import encode
from streams.consumer import DecisionConsumer
from streams.producer import DecisionProducer

pytestmark = pytest.mark.broker


def dvi(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvi.cli", *args], capture_output=True, text=True, timeout=timeout)


def overrides(cfg) -> list[str]:
    return [f"stream.bootstrap_servers={cfg.bootstrap_servers}", f"stream.topic={cfg.topic}",
            f"stream.dlq_topic={cfg.dlq_topic}", f"stream.control_topic={cfg.control_topic}"]


def test_tail_prints_lines_and_json(stream_cfg, make_record):
    records = [make_record(f"req-{i}", rounds=3, seed=i) for i in range(3)]
    raw = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    raw.send(stream_cfg.topic, key=b"junk", value=b"not a record", partition=0)
    for r in records:
        raw.send(stream_cfg.topic, key=r.request_id.encode(), value=encode(r), partition=0)
    raw.flush()
    raw.close()

    lines = dvi("stream", "tail", "--from-beginning", "--max", "3", *overrides(stream_cfg))
    assert lines.returncode == 0, lines.stderr
    out = lines.stdout.splitlines()
    assert len(out) == 3
    for line, r in zip(out, records):
        assert f"request={r.request_id}" in line and "drafter=v-test" in line and f"rounds={len(r.rounds)}" in line
    assert "1 invalid record(s) skipped" in lines.stderr

    js = dvi("stream", "tail", "--from-beginning", "--json", "--timeout", "1.5", *overrides(stream_cfg))
    assert js.returncode == 0, js.stderr
    objs = [json.loads(line) for line in js.stdout.splitlines()]
    assert [o["record_id"] for o in objs] == [r.record_id for r in records]
    assert objs[0]["kafka"] == {"topic": stream_cfg.topic, "partition": 0, "offset": 1}
    assert objs[0]["generated_ids"] == records[0].generated_ids and len(objs[0]["rounds"][0]["topk_ids"]) == 5


def test_tail_of_a_missing_topic_is_one_line(stream_cfg):
    proc = dvi("stream", "tail", "--timeout", "1", f"stream.bootstrap_servers={stream_cfg.bootstrap_servers}", "stream.topic=no.such.topic")
    assert proc.returncode == 2 and proc.stderr.startswith("dvi: error: topic 'no.such.topic' does not exist"), proc.stderr


@pytest.mark.parametrize("durable", [False, True], ids=["memory", "data_dir"])
def test_broker_command_runs_until_sigterm(stream_config, durable, tmp_path):
    port = free_port()
    cfg = stream_config(f"127.0.0.1:{port}")
    data = [f"stream.data_dir={tmp_path / 'broker'}"] if durable else []
    children = tmp_path / "children"  # what `dvi broker` spawns is recorded there (dvi.procs) until it stops it
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvi.cli", "broker", f"stream.port={port}", f"stream.topic={cfg.topic}",
         f"stream.dlq_topic={cfg.dlq_topic}", f"stream.control_topic={cfg.control_topic}", "stream.partitions=2", *data],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, REGISTRY_ENV: str(children)},
    )
    try:
        first = proc.stdout.readline()  # blocks until the broker is ready (or dvi exits)
        assert f"Tansu on 127.0.0.1:{port}" in first, first + proc.stderr.read() if proc.poll() is not None else first
        assert (f"(durable, {cfg.topic} kept 168 h)" in first) == durable and ("memory (lost on stop)" in first) == (not durable), first
        admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")
        topics = {t["name"]: len(t["partitions"]) for t in admin.describe_topics([cfg.topic, cfg.dlq_topic, cfg.control_topic])}
        admin.close()
        assert topics == {cfg.topic: 2, cfg.dlq_topic: 1, cfg.control_topic: 1}
        assert len(list(children.glob("*.json"))) == (2 if durable else 1)  # Tansu (and the S3 store), recorded
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert "stopped" in proc.stdout.read()
        assert not list(children.glob("*.json"))  # what it spawned, stopped and forgotten
        deadline = time.monotonic() + 5  # the Tansu child is gone with it: the port is free again
        while time.monotonic() < deadline and not _free(port):
            time.sleep(0.05)
        assert _free(port)
        if durable:  # the topics are files in the folder, and no S3 store process is left behind
            assert any((tmp_path / "broker").rglob("*")), "nothing was written to stream.data_dir"
            left = [cmd for cmd in map(_cmdline, Path("/proc").glob("[0-9]*/cmdline")) if f"streams.s3_store {tmp_path / 'broker'} " in cmd + " "]
            assert not left, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_leftovers(children)  # after a failure above, the Tansu and S3 store it left too


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _cmdline(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_broker_command_refuses_external_kafka():
    proc = dvi("broker", "stream.bootstrap_servers=kafka.example:9092")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "stream.bootstrap_servers is set" in proc.stderr


@pytest.mark.real_model
@pytest.mark.slow
def test_generate_log_sends_the_request_records(stream_cfg):
    args = ("generate", "Name three primary colors.", "--json", "--greedy", "--max-new-tokens", "6", "--log", "stream.chunk_rounds=2")
    up = dvi(*args, *overrides(stream_cfg), timeout=300)
    assert up.returncode == 0, up.stderr
    out = json.loads(up.stdout)
    assert out["stream"]["sent"] >= 1 and out["stream"]["dropped"] == 0
    with DecisionConsumer(stream_cfg, group_id=None, vocab_size=49152) as consumer:
        got = consumer.poll_until(out["stream"]["sent"], timeout_s=10)
    recs = sorted((d.record for d in got), key=lambda r: r.chunk_index)
    assert len(recs) == out["stream"]["sent"] and {r.request_id for r in recs} == {out["request_id"]}
    assert sum((r.generated_ids for r in recs), []) == out["token_ids"]
    assert recs[0].target.name == "SmolLM2-135M-Instruct" and recs[0].drafter_version == out["drafter_version"]
    assert recs[0].topk == 8 and recs[-1].final
    # an unreachable broker: covered without the model by test_stream_outage (the CLI only adds close())


def test_producer_and_tail_agree_on_the_default_topic_names(stream_cfg, make_record):
    """Records written by the library producer are what the CLI reads (no hidden serialization difference)."""
    with DecisionProducer(stream_cfg) as p:
        p.submit(make_record("lib", rounds=2))
        assert p.flush(10)
    proc = dvi("stream", "tail", "--from-beginning", "--max", "1", *overrides(stream_cfg))
    assert proc.returncode == 0 and "request=lib" in proc.stdout, proc.stderr


def test_schema_prints_the_proto_of_the_message_the_codec_writes():
    """`dvi stream schema` is the .proto a registry takes: every field of every message the codec builds, with its
    number, type and presence, and nothing else."""
    import re

    from google.protobuf.descriptor import FieldDescriptor

    from dvi.record_proto import message_class

    proc = dvi("stream", "schema", timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith('syntax = "proto3";') and "package dvi.records.v2;" in text
    printed = {}
    for message, body in re.findall(r"message (\w+) \{\n(.*?)\n\}", text, re.S):
        for label, kind, name, number in re.findall(r"^  (optional |repeated )?(\w+) (\w+) = (\d+);", body, re.M):
            printed[(message, name)] = (int(number), kind, label.strip())
    names = {FieldDescriptor.TYPE_STRING: "string", FieldDescriptor.TYPE_BYTES: "bytes", FieldDescriptor.TYPE_BOOL: "bool",
             FieldDescriptor.TYPE_DOUBLE: "double", FieldDescriptor.TYPE_UINT32: "uint32", FieldDescriptor.TYPE_INT64: "int64"}
    built = {}
    record = message_class().DESCRIPTOR
    for d in (record, record.fields_by_name["target"].message_type, record.fields_by_name["sampling"].message_type):
        for f in d.fields:
            kind = f.message_type.name if f.message_type else names[f.type]
            label = "repeated" if f.is_repeated else "optional" if f.has_presence and not f.message_type else ""
            built[(d.name, f.name)] = (f.number, kind, label)
    assert printed == built and len(built) == 32
