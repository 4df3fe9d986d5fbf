"""serve.vllm.cpu_bind: the cores vLLM's worker pins its threads to, checked against this machine and against the vLLM
engines already pinned on it (dvi.hardware), handed to vLLM's server (dvi.cli.vllm.server), and, for a list of cores,
the only cores every process of the replica runs on (`dvi serve`, the real demo target, a real broker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dvi.cli.vllm import server as vllm_server
from dvi.config import TrainerConfig, VllmConfig, load_config
from dvi.errors import DviError
from dvi import hardware
from dvi.hardware import VLLM_WORKER, Pick, bound_cores, parse_cores, pinned_engines, replica_cores, shared_cores
from dvi.procs import free_port

PINNED_WORKER = f"""
import os, sys, time
with open("/proc/self/comm", "w") as f:
    f.write({VLLM_WORKER!r})
os.sched_setaffinity(0, {{int(sys.argv[1])}})
print("pinned", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("value", ["auto", "nobind", "0", "0-1", "1,3", "0-3,8"])
def test_a_core_list_auto_or_nobind_is_taken(value):
    assert VllmConfig(cpu_bind=value).cpu_bind == value


@pytest.mark.parametrize("value", ["all", "0|1", "1-", "-1", "0,,1", " 0", ""])
def test_anything_else_is_refused_with_the_key_and_what_is_expected(value):
    with pytest.raises(DviError, match=r"serve\.vllm\.cpu_bind=.*expected auto, nobind or a list of cores"):
        VllmConfig(cpu_bind=value)


def test_a_single_core_from_the_command_line_is_a_string():
    assert load_config(["serve.vllm.cpu_bind=1"]).serve.vllm.cpu_bind == "1"


def test_a_core_list_reads_as_linux_writes_it():
    assert parse_cores("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cores("5") == {5}


def test_the_cores_an_engine_pins_are_every_usable_one_the_listed_ones_or_none():
    usable = frozenset(os.sched_getaffinity(0))
    assert bound_cores("auto") == usable
    assert bound_cores("nobind") == frozenset()
    first = min(usable)
    assert bound_cores(str(first)) == {first}


def test_a_core_this_process_may_not_run_on_is_refused_naming_it():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(DviError, match=rf"serve\.vllm\.cpu_bind='{missing}' names cores {missing}, which this process may not run on"):
        bound_cores(str(missing))


def test_vllms_server_is_started_with_the_binding():
    cfg = load_config(["serve.vllm.cpu_bind=1"])
    assert vllm_server.environment(cfg, {}, plain=True)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert vllm_server.environment(load_config([]), {}, plain=True)["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_a_pinned_vllm_worker_on_this_host_is_found_with_its_cores():
    usable = sorted(os.sched_getaffinity(0))
    assert (os.cpu_count() or 1) >= 2, "pinning means something only on a machine with two cores or more"
    child = subprocess.Popen([sys.executable, "-c", PINNED_WORKER, str(usable[0])], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "pinned"
        found = pinned_engines()
        assert found.get(child.pid) == {usable[0]}
        assert os.getpid() not in found  # this process is not a vLLM worker, whatever its cores
    finally:
        child.kill()
        child.wait()
    assert child.pid not in pinned_engines()


def test_an_unpinned_vllm_worker_is_not_reported(tmp_path: Path):
    for pid, allowed in ((10, "0-1"), (11, "0")):
        task = tmp_path / str(pid) / "task" / str(pid)
        task.mkdir(parents=True)
        (tmp_path / str(pid) / "comm").write_text(VLLM_WORKER + "\n")
        (task / "status").write_text(f"Name:\t{VLLM_WORKER}\nCpus_allowed_list:\t{allowed}\n")
    (tmp_path / "self").mkdir()
    assert pinned_engines(tmp_path, online=2) == {11: {0}}


def test_pinning_onto_a_core_another_engine_holds_is_named_with_the_free_cores():
    usable = frozenset({0, 1, 2, 3})
    msg = shared_cores("auto", usable, {123: frozenset({0, 1})}, usable)
    assert "serve.vllm.cpu_bind=auto pins this replica's engine to cores 0-3" in msg
    assert "pid 123 on 0-1" in msg and "serve.vllm.cpu_bind=2-3 is free here" in msg
    assert shared_cores("2-3", parse_cores("2-3"), {123: frozenset({0, 1})}, usable) is None
    assert shared_cores("nobind", frozenset(), {123: frozenset({0, 1})}, usable) is None
    assert shared_cores("auto", usable, {}, usable) is None
    full = shared_cores("1", parse_cores("1"), {123: frozenset({0}), 124: frozenset({1, 2, 3})}, usable)
    assert "pid 124 on 1" in full and "pid 123" not in full and "no core is free of a pinned engine" in full


def test_a_replica_with_cores_of_its_own_is_narrowed_to_them_and_auto_or_nobind_to_nothing():
    assert replica_cores("1", frozenset({1})) == {1}
    assert replica_cores("0-3,8", frozenset({0, 1, 2, 3, 8})) == {0, 1, 2, 3, 8}
    assert replica_cores("auto", frozenset({0, 1})) is None
    assert replica_cores("nobind", frozenset()) is None


NARROWED = """
import argparse, os, sys
from dvi.cli import args
args.serve(argparse.Namespace(overrides=sys.argv[1:]))
print(sorted(os.sched_getaffinity(0)), "torch" in sys.modules)
"""


def test_dvi_serve_is_narrowed_to_its_cores_before_torch_loads():
    """`dvi serve`'s command-line check (dvi.cli.args.serve) narrows the process to the replica's cores for vLLM's
    own server, before any import of torch; nothing for auto, nor for dvi's engine (serve.vllm.cpu_bind is vLLM's)."""
    usable = sorted(os.sched_getaffinity(0))
    assert len(usable) >= 2, "narrowing means something only for a process allowed two cores or more"

    def narrowed(*overrides: str) -> str:
        return subprocess.run([sys.executable, "-c", NARROWED, *overrides], capture_output=True, text=True, check=True,
                              timeout=120).stdout.strip()

    assert narrowed("serve.engine=vllm-server", f"serve.vllm.cpu_bind={usable[-1]}") == f"[{usable[-1]}] False"
    assert narrowed("serve.engine=vllm-server") == f"{usable} False"
    assert narrowed("serve.engine=dvi", f"serve.vllm.cpu_bind={usable[-1]}") == f"{usable} False"


def session_cores(sid: int) -> dict[int, tuple[str, set[str]]]:
    """Every process in session `sid`: its name (/proc comm) and the allowed cores of each of its threads, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.getsid(int(entry.name)) != sid:
                continue
            lists = {line.split(":", 1)[1].strip() for task in (entry / "task").iterdir()
                     for line in (task / "status").read_text().splitlines() if line.startswith("Cpus_allowed_list:")}
            found[int(entry.name)] = ((entry / "comm").read_text().strip(), lists)
        except OSError:  # ended while read
            continue
    return found


@pytest.mark.slow
@pytest.mark.broker
@pytest.mark.real_model
def test_every_process_of_a_replica_given_a_core_runs_on_that_core_alone(stream_cfg, tmp_path):
    """`dvi serve serve.vllm.cpu_bind=<core>` (vLLM's own server): the server, its engine process and its worker are
    allowed that core alone, every thread of them (`import torch` in a process allowed more cores visits each in turn)."""
    core = str(max(os.sched_getaffinity(0)))
    cmd = [sys.executable, "-m", "dvi.cli", "serve", "serve.engine=vllm-server", f"serve.vllm.cpu_bind={core}",
           f"serve.port={free_port()}", "tracking.enabled=false", f"stream.bootstrap_servers={stream_cfg.bootstrap}",
           f"stream.topic={stream_cfg.topic}", f"stream.dlq_topic={stream_cfg.dlq_topic}",
           f"stream.control_topic={stream_cfg.control_topic}", f"serve.swap.store={tmp_path / 'store'}", "stream.replica_id=bound"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True)
    try:
        deadline, seen = time.monotonic() + 600, {}
        while not any(name == VLLM_WORKER for name, _ in seen.values()):  # the last of the processes vLLM starts
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, f"no vLLM worker within 600 s; the session held {seen}"
            time.sleep(0.5)
            seen = session_cores(proc.pid)
        assert len(seen) >= 3, seen  # the server, its engine process, the worker (and any helper they started)
        assert all(lists == {core} for _, lists in seen.values()), seen
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# trainer.cpu_bind: the cores the trainer runs on (dvi.cli.args.train, before torch loads)

TRAINER_CHECK = r"""
import argparse, os, sys
from dvi.cli import args
cfg = args.train(argparse.Namespace(overrides=sys.argv[1:]))
import torch
print(cfg.trainer.cpu_bind, sorted(os.sched_getaffinity(0)), torch.get_num_threads())
"""


@pytest.mark.parametrize("value", ["auto", "1", "0-1", "1,3"])
def test_the_trainers_cores_are_auto_or_a_core_list(value):
    assert TrainerConfig(cpu_bind=value).cpu_bind == value


@pytest.mark.parametrize("value", ["nobind", "all", "1-", " 0", ""])
def test_anything_else_for_the_trainers_cores_is_refused(value):
    with pytest.raises(DviError, match=r"trainer\.cpu_bind=.*expected auto or a list of cores"):
        TrainerConfig(cpu_bind=value)


def test_a_trainer_given_a_core_runs_on_it_alone_with_one_torch_thread():
    usable = sorted(os.sched_getaffinity(0))
    assert len(usable) >= 2, "a core of its own means something only on a machine with two cores or more"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    run = lambda *overrides: subprocess.run([sys.executable, "-c", TRAINER_CHECK, *overrides], env=env,  # noqa: E731
                                            capture_output=True, text=True)
    pinned = run(f"trainer.cpu_bind={usable[-1]}")
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split(None, 1) == [str(usable[-1]), f"[{usable[-1]}] 1\n"]
    free = run()
    assert free.returncode == 0 and free.stdout.startswith(f"auto {usable} "), free.stderr
    missing = run(f"trainer.cpu_bind={usable[-1] + 1}")
    assert missing.returncode != 0 and f"trainer.cpu_bind='{usable[-1] + 1}' names cores" in missing.stderr


def test_a_machine_split_between_serving_and_a_trainer():
    from dvi.hardware import core_list, split_cores

    assert core_list({0, 1, 2, 3, 8}) == "0-3,8" and core_list({5}) == "5"
    assert split_cores(frozenset({0, 1}), "1") == ("0", "1")
    assert split_cores(frozenset(range(8)), "6-7") == ("0-5", "6-7")
    with pytest.raises(DviError, match="not among the usable"):
        split_cores(frozenset({0, 1}), "2")
    with pytest.raises(DviError, match="leave serving no core"):
        split_cores(frozenset({0, 1}), "0-1")


# trainer.cpu_priority: how the online trainer shares the CPU with serving (dvi.cli.args.online_train, before torch loads)

PRIORITY_CHECK = r"""
import argparse, os, sys, threading
from dvi.cli import args
cfg = args.online_train(argparse.Namespace(overrides=sys.argv[1:]))
import torch
torch.ones(256, 256) @ torch.ones(256, 256)  # torch's threads started after
seen = []
t = threading.Thread(target=lambda: seen.append((os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))))
t.start(); t.join()
print(cfg.trainer.cpu_priority, os.sched_getscheduler(0) == os.SCHED_IDLE, os.getpriority(os.PRIO_PROCESS, 0),
      seen[0][0] == os.SCHED_IDLE, seen[0][1])
"""


def test_the_trainers_cpu_priority_is_one_of_the_named():
    from dvi.cli.up import train_share

    for value in ("auto", "normal", "nice", "idle", "pause"):
        assert TrainerConfig(cpu_priority=value).cpu_priority == value
    assert TrainerConfig().cpu_priority == "auto"
    with pytest.raises(DviError, match=r"trainer\.cpu_priority='low'.*expected auto, normal, nice, idle, pause"):
        TrainerConfig(cpu_priority="low")
    named = lambda value: Pick(value, "trainer.cpu_priority")  # noqa: E731
    assert train_share(TrainerConfig(cpu_bind="1"), named("idle")).startswith("cores 1 (trainer.cpu_bind), CPU priority idle")
    assert train_share(TrainerConfig(), named("normal")) == "every core, CPU priority normal (trainer.cpu_priority): running beside requests"
    assert train_share(TrainerConfig(pause_share=0), named("pause")).endswith(": stopped while the server has a request in "
                                                                             "flight, training between requests")
    assert "in flight but for 25% of every 10 s (trainer.pause_share; down to 2.5% while the gate refuses its candidates: " \
        "trainer.pause_share_min), which it runs alone while serving waits (a turn ends early where it has nothing to do), " \
        "training between requests" in train_share(TrainerConfig(pause_share=0.25), named("pause"))
    assert "in flight but for 25% of every 10 s (trainer.pause_share), which it" in \
        train_share(TrainerConfig(pause_share=0.25, pause_share_min=0.25), named("pause"))  # no lower claim
    why = "auto: it trains on the CPU, on 2 of the 2 cores serving runs on"
    assert f"CPU priority pause ({why}): stopped while" in train_share(TrainerConfig(), Pick("pause", why))


def test_auto_pauses_a_trainer_on_the_cpu_cores_serving_runs_on_and_leaves_one_on_a_gpu_or_cores_of_its_own(monkeypatch):
    """`dvi.hardware.pick_cpu_priority` on a 4-core machine (the cores this process may use)."""
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    pick = hardware.pick_cpu_priority
    assert pick("nice", "cpu", "auto", "auto") == Pick("nice", "trainer.cpu_priority")  # named: as is
    assert pick("auto", "cpu", "auto", "auto") == Pick("pause", "auto: it trains on the CPU, on 4 of the 4 cores serving runs on")
    assert pick("auto", "cpu", "3", "auto").value == "pause"  # its own core, but serving's threads run on every core
    assert pick("auto", "cpu", "2-3", "nobind").value == "pause"  # an unpinned server runs on any core
    assert pick("auto", "cpu", "1-3", "0-1").why == "auto: it trains on the CPU, on 1 of the 2 cores serving runs on"
    assert pick("auto", "cpu", "2-3", "0-1") == Pick("normal", "auto: it trains on cores of its own, 2-3; serving runs on 0-1")
    assert pick("auto", "cuda:1", "auto", "auto") == Pick("normal", "auto: it trains on the GPU")
    with pytest.raises(DviError, match=r"trainer.cpu_bind='7' names cores 7"):
        pick("auto", "cpu", "7", "auto")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # every GPU hidden: the trainer's torch sees none
    assert pick("auto", "auto", "auto", "auto").value == "pause"
    assert (hardware.device_type("cpu"), hardware.device_type("cuda"), hardware.device_type("cuda:1")) == ("cpu", "cuda", "cuda")


def test_the_online_trainer_and_every_thread_it_starts_run_at_its_cpu_priority():
    """`dvi train`'s process: SCHED_IDLE or nice 19 from before torch loads, and so every thread it starts after."""
    run = lambda *overrides: subprocess.run([sys.executable, "-c", PRIORITY_CHECK, *overrides],  # noqa: E731
                                            capture_output=True, text=True)
    base, base_idle = os.getpriority(os.PRIO_PROCESS, 0), str(os.sched_getscheduler(0) == os.SCHED_IDLE)  # as inherited
    idle = run("trainer.cpu_priority=idle")
    assert idle.returncode == 0, idle.stderr
    assert idle.stdout.split() == ["idle", "True", str(base), "True", str(base)]
    nice = run("trainer.cpu_priority=nice")
    assert nice.returncode == 0 and nice.stdout.split() == ["nice", base_idle, "19", base_idle, "19"], nice.stderr
    auto = run()  # auto settles to normal or pause (dvi up's hold), and neither changes the process's priority
    assert auto.returncode == 0 and auto.stdout.split() == ["auto", base_idle, str(base), base_idle, str(base)], auto.stderr
