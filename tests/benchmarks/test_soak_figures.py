"""The soak benchmark's figures and bookkeeping (`benchmarks.soak`), against plain references: the fault schedule,
flatness of a series, percentiles, the ledger against the topic, the process registry it reads, and the cores each
replica is pinned to (with `benchmarks.bench_restart`'s schemes); and, on the real broker, the hostile burst's replay
of the newest signed control message."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from benchmarks.bench_restart import binds, halves
from benchmarks.soak import (FAULTS, Options, Soak, all_flat, exactly_once, flatness, hostile_burst, is_flat, lives, percentile,
                             main, proc_brief, read_to_end, registry, replica_binds, slope_per_min, table, tree, unrecovered, usage)
from dvi import control, keys


def test_the_schedule_kills_each_part_in_turn_and_bursts_once():
    opt = Options(minutes=120, fault_every_min=20)
    assert opt.fault_at() == [(1200.0, "train"), (2400.0, "broker"), (3600.0, "mlflow"), (4800.0, "serve"),
                              (5400.0, "hostile"), (6000.0, "up")]
    quick = Options.quick().fault_at()
    assert [f for _, f in quick if f != "hostile"] == list(FAULTS)  # each once
    assert sum(f == "hostile" for _, f in quick) == 1 and all(t < Options.quick().minutes * 60 - 30 for t, _ in quick)


def test_slope_is_the_least_squares_line():
    samples = [(60.0 * i, 100 + 3.0 * i + (-1) ** i * 0.5) for i in range(20)]  # 3 per minute, with jitter
    n = len(samples)
    mt, mv = sum(t for t, _ in samples) / n, sum(v for _, v in samples) / n
    ref = sum((t - mt) * (v - mv) for t, v in samples) / sum((t - mt) ** 2 for t, _ in samples) * 60
    assert slope_per_min(samples) == pytest.approx(ref) and slope_per_min(samples) == pytest.approx(3.0, abs=0.05)
    assert slope_per_min([(5.0, 1.0), (5.0, 2.0)]) == 0.0


def test_flat_means_the_second_half_and_the_trend_within_five_percent():
    steady = [(30.0 * i, 1000 + (i % 3)) for i in range(40)]
    f = flatness(steady)
    assert is_flat(f) and f["median_ratio"] == pytest.approx(1.0, abs=0.01)
    creeping = [(30.0 * i, 1000 + 4 * i) for i in range(40)]  # +156 over the window: 15%
    f = flatness(creeping)
    assert not is_flat(f)
    first = [v for t, v in creeping if t < 30 * 39 / 2]
    assert f["first"] == statistics.median(first)
    assert f["growth"] == pytest.approx(slope_per_min(creeping) * 30 * 39 / 60 / statistics.median(first))
    spike = [(30.0 * i, 1000 + (500 if i == 30 else 0)) for i in range(40)]  # one transient: the medians hold
    assert is_flat(flatness(spike)) is True
    assert flatness(steady[:3]) is None and is_flat(None) is None


def test_each_life_is_judged_over_the_last_hour_of_it_after_its_warm_up():
    # a row every minute for 120 minutes: the trainer restarted at 60 (its first life creeps), the replica serving
    # from minute 5 on, the broker restarted at 110 (its last life too short to judge)
    rows = []
    for m in range(121):
        procs = {"train": {"pid": 10 if m < 60 else 11, "rss_mib": 1000 + (8 * m if m < 60 else 0), "fds": 30},
                 "serve": {"pid": 20, "rss_mib": 5000 + (m % 2), "fds": 190},
                 "broker": {"pid": 30 if m < 110 else 31, "rss_mib": 80, "fds": 5 + (m >= 110) * 9},
                 "r2:r2": {"pid": 40, "rss_mib": 5000 + 200 * (m >= 70), "fds": 190 + 6 * (m >= 70)}}
        rows.append({"t": 60.0 * m, "procs": procs, "replicas": {"r1": {"version": "v"} if m >= 5 else None,
                                                                 "r2": {"version": "v" if m < 70 else "w"}}})
    got = {(p["name"], p["pid"]): p for p in lives(rows, span_s=3600, warmup_s=600)}
    assert sorted(got) == [("broker", 30), ("broker", 31), ("r2:r2", 40), ("serve", 20), ("train", 10), ("train", 11)]
    swapped = got[("r2:r2", 40)]  # its warm-up lasts until its first swap (70): from then on it holds two drafters
    assert (swapped["from_t"], swapped["to_t"]) == (4200.0, 7200.0) and is_flat(swapped["rss"]) and is_flat(swapped["fds"])
    first = got[("train", 10)]  # judged from its warm-up (10) to its end (59): 8 MiB a minute on 1,080 is not flat
    assert (first["from_t"], first["to_t"]) == (600.0, 3540.0) and first["samples"] == 50
    assert first["rss"] == flatness([(60.0 * m, 1000 + 8 * m) for m in range(10, 60)]) and is_flat(first["rss"]) is False
    assert is_flat(got[("train", 11)]["rss"]) is True and got[("train", 11)]["from_t"] == 4200.0
    serve = got[("serve", 20)]  # born when it first served (5): the last hour of its life, 60-120
    assert (serve["from_t"], serve["to_t"]) == (3600.0, 7200.0) and is_flat(serve["fds"]) is True
    assert got[("broker", 31)]["rss"] is None and got[("broker", 31)]["fds"] is None  # 11 minutes lived: 1 after warm-up
    assert [p["name"] for p in lives(rows, 3600, 600)] == ["broker", "broker", "r2:r2", "serve", "train", "train"]
    procs = list(got.values())
    assert all_flat(procs, "rss") is False and all_flat(procs, "fds") is True
    assert all_flat([got[("broker", 31)]], "rss") is None  # nothing judged: no verdict
    text = table({"minutes": 120.0, "checks": {}, "exactly_once": None, "final_broker": {"error": "-"}, "requests": {},
                  "p99_s": {"first": None, "last": None}, "published": 0, "served": {}, "faults": [], "procs": procs,
                  "unjudged": ["up"]})
    assert "| train | 10 | 0.0-59.0 | 10.0-59.0 | 1176 / 1376 | 8.00 | 30 / 30 | **no**, yes |" in text
    assert "| broker | 31 | 110.0-120.0 | no (too short) | - / - | - | - / - | -, - |" in text
    assert "No life long enough to judge memory and descriptors: up." in text


def test_judge_rereads_a_stored_run_and_fails_on_a_creeping_life(tmp_path, capsys):
    rows = [{"t": 60.0 * m, "procs": {"train": {"pid": 7, "rss_mib": 1000 + 8 * m, "fds": 30}}, "replicas": {}}
            for m in range(121)]
    path = tmp_path / "soak.json"
    path.write_text(json.dumps({"rows": rows, "options": {"minutes": "120.0", "warmup_min": "10.0"}}))
    assert main(["--judge", str(path)]) == 1
    out = capsys.readouterr().out
    assert "| train | 7 | 0.0-120.0 | 60.0-120.0 |" in out and "memory flat: False; descriptors flat: True" in out
    path.write_text(json.dumps({"rows": [{**r, "procs": {"train": {"pid": 7, "rss_mib": 1000, "fds": 30}}} for r in rows],
                                "options": {"minutes": "120.0", "warmup_min": "10.0"}}))
    assert main(["--judge", str(path)]) == 0


@pytest.mark.parametrize("q", [50, 90, 99, 100, 37])
def test_percentile_is_the_nearest_rank(q):
    for n in (10, 200, 7):
        values = [float(v) for v in range(n, 0, -1)]  # unsorted
        assert percentile(values, q) == sorted(values)[max(0, -(-q * n // 100) - 1)]  # the ceil(q n / 100)-th smallest
    assert percentile([], q) is None and percentile([7.0], q) == 7.0


def test_the_ledger_against_the_committed_offsets_finds_the_lost_the_twice_trained_and_the_unknown():
    topic = [(0, 0, "a"), (0, 1, "b"), (1, 0, "c"), (1, 1, "d"), (1, 2, "e")]
    whole = exactly_once(topic, [("a", "t"), ("b", "h"), ("c", "t"), ("d", "t")], {0: 2, 1: 2})
    assert (whole["lost_n"], whole["pending_n"], whole["twice_n"], whole["unknown_n"]) == (0, 1, 0, 0)  # e: not read yet
    out = exactly_once(topic + [(1, 3, "a")], [("a", "t"), ("b", "t"), ("b", "t"), ("e", "t"), ("z", "t")], {0: 2, 1: 2})
    assert out["lost"] == ["c", "d"] and out["pending_n"] == 0 and out["twice"] == ["b"] and out["unknown_n"] == 1
    assert out["topic_duplicates"] == 1
    assert exactly_once(topic, [], {})["pending_n"] == 5  # nothing committed: nothing lost yet


def test_registry_names_children_under_their_part_and_usage_reads_the_process_tree(tmp_path):
    me, parent = os.getpid(), os.getppid()
    (tmp_path / "1.json").write_text(json.dumps({"pid": parent, "start": "1", "name": "broker", "parent": 0}))
    (tmp_path / "2.json").write_text(json.dumps({"pid": me, "start": "2", "name": "tansu", "parent": parent}))
    (tmp_path / "3.json").write_text("{not json")
    assert sorted(registry(tmp_path)) == ["broker", "broker/tansu"]
    assert me in tree(parent)
    rss, fds, backed = usage(me)
    assert rss > 10 and fds >= 3 and 0 < backed < rss  # this interpreter's mapped libraries, and its heap beside them
    assert usage(2 ** 22 + 7) is None  # above pid_max: no such process


def test_proc_brief_says_what_a_process_runs_and_where_it_may():
    core = min(os.sched_getaffinity(0))
    child = subprocess.Popen(["sleep", "30"], preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        time.sleep(0.5)
        brief = proc_brief(child.pid)
        assert brief["cmd"].startswith("sleep 30") and brief["state"].startswith("S")
        assert brief["cpus"] == str(core) and brief["ran_s"] >= 0 and brief["waited_s"] >= 0
        assert proc_brief(os.getpid())["cpus"] != "" and proc_brief(2 ** 22 + 7) is None
    finally:
        child.kill()
        child.wait()


def test_a_part_that_never_came_back_fails_its_check_and_the_table_says_why():
    faults = [{"t": 1200.0, "fault": "train", "recovered_s": 23.0}, {"t": 2400.0, "fault": "broker", "recovered_s": 0.0},
              {"t": 3000.0, "fault": "hostile"},
              {"t": 6000.0, "fault": "up", "recovered_s": None, "gave_up_s": 905.0, "gave_up": "the new dvi up failed: timeout"}]
    assert unrecovered(faults) == ["up at 100.0 min"]  # back at once (0 s) is back; the burst is no kill
    summary = {"minutes": 120.0, "checks": {"every killed part back (within 20 minutes)": not unrecovered(faults)},
               "exactly_once": {"on_topic": 3, "in_ledger": 3, "lost_n": 0, "twice_n": 0, "pending_n": 0}, "dead_lettered": 0,
               "requests": {}, "p99_s": {"first": None, "last": None}, "published": 0, "served": {}, "procs": {},
               "faults": faults, "final_broker": {"read_s": 12.5, "records": 3, "dead_lettered": 0}}
    text = table(summary)
    assert "| every killed part back (within 20 minutes) | **no** |" in text
    assert "| up | 100.0 | never: the new dvi up failed: timeout |" in text and "| broker | 40.0 | 0.0 |" in text
    assert "the broker alone read the topic back in 12.5 s" in text


def test_a_cache_too_deep_for_a_socket_name_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """Under a deep --out, dvi's scratch folder would leave no room for vLLM's socket names, its processes would write
    to /tmp, and the check of writes outside the cache would fail on them: the soak says so at once."""
    monkeypatch.setenv("DVI_CACHE", os.environ.get("DVI_CACHE", ""))  # the soak points DVI_CACHE at its own cache
    deep = tmp_path / ("d" * 100)
    with pytest.raises(SystemExit, match="too deep"):
        Soak(Options(out=deep), [])
    assert not list(tmp_path.rglob("*.pid")), "nothing was started"


def test_a_run_starts_from_a_copy_of_the_compile_cache_it_is_given(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DVI_CACHE", os.environ.get("DVI_CACHE", ""))  # the soak points DVI_CACHE at its own cache
    tmp_path = tmp_path_factory.mktemp("s")  # short: the cache's scratch folder must leave room for a socket's name
    given = tmp_path / "compile"
    (given / "inductor" / "ab").mkdir(parents=True)
    (given / "inductor" / "ab" / "graph.py").write_text("compiled")
    soak = Soak(Options(out=tmp_path / "run", compile_from=given), [])
    copied = soak.cache / "compile" / "inductor" / "ab" / "graph.py"
    assert copied.read_text() == "compiled" and not copied.is_symlink() and not (soak.cache / "compile").is_symlink()
    assert not (Soak(Options(out=tmp_path / "cold"), []).cache / "compile").exists()  # none given: compiled cold


def test_two_replicas_get_disjoint_halves_of_the_cores_that_cover_them():
    for cores in ([0, 1], [0, 1, 2], [0, 1, 2, 3], [2, 5, 7, 9]):
        first, second = halves(cores)
        a, b = ({int(c) for c in half.split(",")} for half in (first, second))
        assert a and b and not a & b and a | b == set(cores)
    assert halves([0, 1]) == ("0", "1")
    assert binds("split", [0, 1]) == ("0", "1") and binds("auto", [0, 1]) == ("auto", "auto")


def test_the_soaks_replicas_are_split_unless_a_binding_is_given_or_there_is_one_core():
    assert replica_binds([], [0, 1]) == {"r1": ["serve.vllm.cpu_bind=0"], "r2": ["serve.vllm.cpu_bind=1"]}
    assert replica_binds(["serve.vllm.cpu_bind=nobind"], [0, 1]) == {"r1": [], "r2": []}
    assert replica_binds(["trainer.log_every=1"], [0]) == {"r1": [], "r2": []}


@pytest.mark.broker
def test_the_hostile_burst_replays_the_newest_signed_control_message(stream_cfg):
    signer = keys.Keys(signing={"trainer": Ed25519PrivateKey.generate()})
    older, newest = (control.encode(control.DrafterPublished(version=v, uri=f"/store/{v}", sha256="0" * 64), signer)
                     for v in ("d0001", "d0002"))
    producer = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    for data in (older, b'{"unsigned": true}', newest):
        producer.send(stream_cfg.control_topic, data).get(timeout=30)
    producer.close()

    sent = hostile_burst(SimpleNamespace(stream=stream_cfg), [])
    assert sent["records"] == 5 and sent["control"] == 3 and sent["replayed"] == 1 and sent["not acknowledged"] == {}, sent
    reader = KafkaConsumer(bootstrap_servers=stream_cfg.bootstrap, enable_auto_commit=False, consumer_timeout_ms=10000)
    tp = TopicPartition(stream_cfg.control_topic, 0)
    reader.assign([tp])
    reader.seek_to_beginning(tp)
    values = [m.value for m in reader]
    reader.close()
    assert values[-1] == newest and len(values) == 6  # the three above, the unsigned and forged ones, the replay


@pytest.mark.broker
def test_a_topic_is_read_to_the_end_offsets_it_had_or_the_read_says_how_far_it_got(stream_cfg):
    producer = KafkaProducer(bootstrap_servers=stream_cfg.bootstrap)
    for i in range(30):
        producer.send(stream_cfg.topic, f"m{i}".encode(), partition=i % 3).get(timeout=30)
    producer.close()
    got = read_to_end(stream_cfg.bootstrap, stream_cfg.topic, 60)
    assert sorted(int(m.value[1:]) for m in got) == list(range(30))  # each once, from every partition
    assert read_to_end(stream_cfg.bootstrap, stream_cfg.dlq_topic, 60) == []  # an empty topic: at once
    with pytest.raises(TimeoutError, match=r"decisions not read to its end offsets within 0 s: \{0: '0/10'"):
        read_to_end(stream_cfg.bootstrap, stream_cfg.topic, 0)


def test_a_topic_that_could_not_be_read_back_leaves_its_check_open_and_says_why():
    summary = {"minutes": 120.0, "checks": {"every record the trainer committed is in its ledger exactly once": None},
               "exactly_once": None, "dead_lettered": None, "requests": {}, "p99_s": {"first": None, "last": None},
               "published": 0, "served": {}, "procs": {}, "faults": [], "final_broker": {"error": "broker did not start"}}
    text = table(summary)
    assert "| every record the trainer committed is in its ledger exactly once | - |" in text
    assert "Records: the topic could not be read back: broker did not start." in text


def test_the_second_replica_waits_for_this_starts_broker_not_an_earlier_ones(tmp_path):
    log = tmp_path / "up.log"
    log.write_text("dvi up: broker ready (pid 1, an earlier start)\n")
    stack = {"log": log, "from": log.stat().st_size}
    t0 = time.monotonic()
    Soak.wait_broker({**stack, "done": True})  # a start that ended (failed): no wait
    assert time.monotonic() - t0 < 0.4

    def starting():
        time.sleep(1.0)
        with log.open("a") as f:
            f.write("dvi up: broker ready (pid 2)\n")

    threading.Thread(target=starting, daemon=True).start()
    Soak.wait_broker(stack, timeout_s=30)
    assert time.monotonic() - t0 >= 1.0  # not the earlier start's line
