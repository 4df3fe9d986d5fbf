"""`dvi up`: the restart backoff and the plan as pure logic; then the real stack (broker, MLflow, serve, train)
started, asked, a part killed and restarted, and stopped with no process left behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import uuid
from pathlib import Path

import pytest
import requests
from child_env import clean_env

from dvi import mlflow_view
from dvi.cli.up import MAX_BACKOFF_S, STABLE_S, Part, Supervisor, next_backoff, plan, prepare_pair
from dvi.config import load_config
from dvi.errors import DviError
from dvi.hardware import pick_engine
from dvi.mlflow_login import local_login
from dvi.procs import REGISTRY_ENV, _zombie, free_port, spawn
from dvi.tracking import rest


def test_backoff_doubles_to_a_cap_and_starts_over_after_a_stable_run():
    delays, previous = [], None
    for _ in range(8):
        previous = next_backoff(previous, uptime_s=2.0)
        delays.append(previous)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30] and MAX_BACKOFF_S == 30
    assert next_backoff(30.0, uptime_s=STABLE_S) == 1


def test_plan_leaves_out_what_the_config_points_elsewhere():
    assert [p.name for p in plan(load_config([]))] == ["broker", "mlflow", "serve", "train"]
    external = load_config(["stream.bootstrap_servers=kafka:9092", "tracking.uri=http://mlflow:5000"])
    assert [p.name for p in plan(external)] == ["serve", "train"]
    assert [p.name for p in plan(load_config(["tracking.enabled=false"]), train=False)] == ["broker", "serve"]
    assert [p.name for p in plan(load_config([]), only={"broker", "serve"})] == ["broker", "serve"]
    with pytest.raises(DviError, match="unknown part"):
        plan(load_config([]), only={"serve", "kafka"})


def processes_with(marker: str) -> list[int]:
    """Pids of processes whose environment holds `marker` (every descendant of `dvi up` inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


class Lines:
    """The stdout of a process, collected by a thread, waited on line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> int:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for i in range(after, len(self.lines)):
                    if text in self.lines[i]:
                        return i
                left = deadline - time.monotonic()
                assert left > 0, f"no '{text}' within {timeout_s} s:\n" + "\n".join(self.lines)
                self._cv.wait(left)


# a part for the supervision tests: it starts a worker of its own (recorded, as a part's broker or MLflow server is),
# then waits
SLEEPER = "from dvi.procs import spawn; import time; spawn('worker', ['sleep', '600']); time.sleep(600)"


class Sleepers(Supervisor):
    """`dvi up`'s supervision of parts that are SLEEPER processes."""

    def _spawn(self, part: Part):
        return spawn(part.name, [sys.executable, "-c", SLEEPER], log_path=self.log_dir / f"{part.name}.log")


def _registry(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in folder.glob("*.json")]


def test_a_pair_that_cannot_be_prepared_is_one_line_naming_the_setting():
    """The child's own check (`dvi models fetch --pair` in a fresh process), its reason carried into dvi up's error."""
    with pytest.raises(DviError, match=r"the model pair could not be prepared \(dvi models fetch --pair\): model\.device=cuda:99"):
        prepare_pair(["model.device=cuda:99"])


def test_a_part_stopped_for_not_coming_back_in_time_has_its_own_leftovers_stopped_and_nothing_else(tmp_path, monkeypatch):
    """A restarted part that is not ready within its time is stopped and started again; what it left running is
    stopped with it, and every other part, with what it started, keeps running."""
    registry = tmp_path / "children"
    monkeypatch.setenv(REGISTRY_ENV, str(registry))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the workers' temporary logs, which a killed part leaves behind
    ready = {"a": True, "b": True}
    said: list[str] = []
    sup = Sleepers([Part(n, [], lambda _c, n=n: None if ready[n] else "not yet", 5.0) for n in ("a", "b")], [],
                   tmp_path / "logs", say=said.append, relay=False)

    def workers_of(pid: int) -> list[int]:
        return [e["pid"] for e in _registry(registry) if e["name"] == "worker" and e["parent"] == pid]

    def until(what, timeout_s: float = 60.0):
        deadline = time.monotonic() + timeout_s
        while not (got := what()):
            assert time.monotonic() < deadline, said
            sup.tick()
            time.sleep(0.1)
        return got

    sup.start()
    try:
        a, b = sup.children["a"].pid, sup.children["b"].pid
        a_worker, = until(lambda: workers_of(a))
        until(lambda: workers_of(b))
        ready["b"] = False
        os.kill(b, signal.SIGKILL)
        until(lambda: "b" in sup.children and sup.children["b"].pid != b)  # restarted
        b2 = sup.children["b"].pid
        b2_worker, = until(lambda: workers_of(b2))
        until(lambda: any("b not ready 5 s after its restart" in line for line in said))
        exited = until(lambda: [line for line in said if line.startswith("dvi up: b exited") and "after" in line][1:])
        assert f"stopped what it left running: worker (pid {b2_worker})" in exited[0], exited
        assert _zombie(b2_worker)  # gone
        assert sup.children["a"].running and sup.children["a"].pid == a and not _zombie(a_worker), said
        assert workers_of(a) == [a_worker]
    finally:
        sup.stop()
    assert _registry(registry) == []


@pytest.mark.slow
@pytest.mark.real_model
@pytest.mark.broker
def test_dvi_up_answers_restarts_a_killed_part_and_stops_everything(demo_target_dir, demo_drafter_dir, tmp_path):
    marker = f"DVI_UP_TEST={uuid.uuid4().hex}"
    api, mlflow_port = free_port(), free_port()
    overrides = [
        f"model.target={demo_target_dir}", f"model.drafter={demo_drafter_dir}", f"model.cache_dir={tmp_path / 'cache'}",
        f"stream.port={free_port()}", f"tracking.port={mlflow_port}", f"tracking.root={tmp_path / 'mlflow'}",
        f"serve.port={api}", f"trainer.store={tmp_path / 'store'}", f"trainer.run_dir={tmp_path / 'run'}",
        "serve.metrics_every_s=5",
    ]  # fmt: skip
    env = clean_env(**{marker.split("=")[0]: marker.split("=")[1], "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", "up", *overrides], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    out = Lines(proc)
    try:
        out.wait_for("Ctrl-C stops everything", 600)
        assert any(f"API     http://127.0.0.1:{api}/v1" in line for line in out.lines), out.lines
        # the supervisor itself never loads torch (the pair is prepared in a child: dvi.cli.up.prepare_pair)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        for part in ("broker", "mlflow", "serve", "train"):
            assert (tmp_path / "cache" / "logs" / f"{part}.log").exists()

        def ask() -> dict:
            r = requests.post(f"http://127.0.0.1:{api}/v1/completions", json={"model": demo_target_dir.name, "prompt": "The capital "
                                                                              "of France is", "max_tokens": 8, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        # the default engine: vLLM's own server with dvi's loop as its plugin where vLLM is installed (its view at
        # /dvi/health), else dvi's server
        loop_view = f"http://127.0.0.1:{api}" + ("/dvi/health" if pick_engine("auto").value == "vllm-server" else "/health")
        first = ask()
        assert first["usage"]["completion_tokens"] == 8
        serving = requests.get(loop_view, timeout=10).json()
        assert serving["drafter_version"] == "init-L2-full" and serving["requests"] >= 1
        status = subprocess.run([sys.executable, "-m", "dvi.cli", "status", "--json", *overrides], capture_output=True, text=True,
                                timeout=120)
        assert status.returncode == 0, status.stderr
        view = json.loads(status.stdout)
        assert view["replicas"][0]["status"] == "ok" and view["replicas"][0]["drafter_version"] == serving["drafter_version"]
        assert view["mlflow"]["uri"] == f"http://127.0.0.1:{mlflow_port}" and "error" not in view["mlflow"], view

        serve_pid = serving.get("server_pid", serving["pid"])  # the process dvi up started (vLLM's API server)
        os.kill(serve_pid, signal.SIGKILL)  # a crash: the supervisor reports it and starts serve again
        i = out.wait_for("serve exited (status -9)", 30)
        out.wait_for("serve ready again", 300, after=i)
        assert ask()["choices"][0]["text"] == first["choices"][0]["text"]
        assert processes_with(marker), "the stack's processes carry the marker"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    assert code == 0, "\n".join(out.lines)
    time.sleep(0.5)
    assert processes_with(marker) == [], "processes left behind after `dvi up` stopped"
    stopped = [line for line in out.lines if line.startswith("dvi up:") and " stopped (status" in line]
    assert [line.split()[2] for line in stopped] == ["train", "serve", "mlflow", "broker"], out.lines


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.real_model
@pytest.mark.broker
def test_detached_stack_publishes_and_swaps_in_a_first_drafter_says_so_and_stops_with_dvi_down(demo_target_dir, demo_eagle3_dir,
                                                                                               tmp_path, monkeypatch):
    """`dvi up --detach` returns once ready; README-style chat requests get a first published drafter that the replica
    swaps in; the decision lines reach up.log (dvi up's terminal) with timestamps; `dvi status` says it; a second
    `dvi up` on the same ports refuses; `dvi down` stops the parts in order and leaves no process behind. The drafter
    is the default kind, EAGLE-3: the trainer holds no copy of the target and trains on the features vLLM's server
    sends with the records."""
    marker = f"DVI_UP_TEST={uuid.uuid4().hex}"
    api, mlflow_port = free_port(), free_port()
    cache = tmp_path / "cache"
    overrides = [
        f"model.target={demo_target_dir}", f"model.drafter={demo_eagle3_dir}", f"model.cache_dir={cache}",
        f"stream.port={free_port()}", f"tracking.port={mlflow_port}", f"tracking.root={tmp_path / 'mlflow'}", f"serve.port={api}",
        # a gate every 15 s that any gain passes: the defaults (60 s, a gain of 0.02) publish within minutes
        # (benchmarks/first_publish.py measures them); this test is about the publish, the swap and what says so
        "trainer.gate_every_s=15", "trainer.min_gain=0",
        "serve.vllm.enforce_eager=true",  # the default engine, uncompiled: the test above starts it compiled
    ]  # fmt: skip
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # the stack makes its own MLflow login
        monkeypatch.delenv(name, raising=False)
    env = clean_env(**{marker.split("=")[0]: marker.split("=")[1], "PYTHONUNBUFFERED": "1"})
    cli = [sys.executable, "-m", "dvi.cli"]
    try:
        up = subprocess.run([*cli, "up", "--detach", *overrides], capture_output=True, text=True, env=env, timeout=900)
        assert up.returncode == 0 and "Ctrl-C stops everything" in up.stdout and "detached (pid" in up.stdout, up.stdout + up.stderr
        again = subprocess.run([*cli, "up", *overrides], capture_output=True, text=True, env=env, timeout=120)
        assert again.returncode == 2 and "already running" in again.stderr, again.stderr

        up_log = cache / "logs" / "up.log"
        prompts = ["Write a Python function that reverses a string.", "Write a short paragraph about the sea at night."]
        deadline = time.monotonic() + 900
        for i in range(60):
            r = requests.post(f"http://127.0.0.1:{api}/v1/chat/completions", timeout=300, json={
                "model": demo_target_dir.name, "messages": [{"role": "user", "content": prompts[i % 2]}], "max_tokens": 32,
                "vllm_xargs": {"dvi_domain": ("code", "prose")[i % 2]}})  # vLLM's server: the domain tag in vllm_xargs
            assert r.status_code == 200, r.text
            if " swapped in (was " in up_log.read_text() or time.monotonic() > deadline:
                break
        text = up_log.read_text()
        # the trainer said what it trains, and that the features come from the records alone (it loaded no target)
        assert "training an EAGLE-3 drafter, precision " in text and "features from records, gate rule" in text, text[-4000:]
        decisions = [line for line in text.splitlines() if " dvi.decision." in line]
        assert any(line.startswith("[train] 20") and " published (parent " in line for line in decisions), text[-4000:]
        assert any(line.startswith("[serve] 20") and " swapped in (was " in line for line in decisions), text[-4000:]
        assert any("gate at step" in line and ": passed: candidate" in line for line in decisions), decisions

        t0 = time.monotonic()
        status = subprocess.run([*cli, "status", *overrides], capture_output=True, text=True, env=env, timeout=60)
        took = time.monotonic() - t0
        assert status.returncode == 0, status.stderr
        assert "published: 1 versions, newest d0001" in status.stdout or "published: 2 versions" in status.stdout, status.stdout
        assert "None" not in status.stdout and "last gate at step" in status.stdout, status.stdout
        print(f"dvi status answered in {took:.2f} s:\n{status.stdout}")

        # MLflow asks for a login, the one in the file `dvi up` names; the serve run's name is the same across restarts,
        # and the link dvi prints opens the saved view
        uri = f"http://127.0.0.1:{mlflow_port}"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            rest(uri, "experiments/get-by-name", {"experiment_name": "dvi"})
        login = local_login(load_config(overrides).tracking)
        assert login == tmp_path / "mlflow" / "login.env" and f"login: user and password in {login}" in up.stdout, up.stdout
        exp = rest(uri, "experiments/get-by-name", {"experiment_name": "dvi"})["experiment"]
        assert f"mlflow: {uri}/#/experiments/{exp['experiment_id']}/runs?viewStateShareKey=dvi" in status.stdout, status.stdout
        runs = rest(uri, "runs/search", body={"experiment_ids": [exp["experiment_id"]]})["runs"]
        assert {r["info"]["run_name"] for r in runs} == {"trainer", f"serve-{socket.gethostname()}-{api}"}, runs
        view = json.loads(json.loads({t["key"]: t["value"] for t in exp["tags"]}[mlflow_view.TAG_KEY])["state"])
        assert view["compareRunCharts"] and view["selectedColumns"] == mlflow_view.view_state([])["selectedColumns"], view
    finally:
        down = subprocess.run([*cli, "down", *overrides], capture_output=True, text=True, env=env, timeout=300)
    assert down.returncode == 0 and "stopped dvi up" in down.stdout, down.stdout + down.stderr
    time.sleep(0.5)
    assert processes_with(marker) == [], "processes left behind after `dvi down`"
    stopped = [line for line in (cache / "logs" / "up.log").read_text().splitlines() if line.startswith("dvi up:") and " stopped (status" in line]
    assert [line.split()[2] for line in stopped] == ["train", "serve", "mlflow", "broker"], stopped


@pytest.mark.faults
@pytest.mark.broker
def test_a_dvi_up_killed_outright_leaves_nothing_the_next_one_does_not_stop(tmp_path):
    """`dvi up` (the broker part: `dvi broker`, which runs Tansu) killed with SIGKILL leaves its parts running, holding
    the broker's port; the next `dvi up` on that cache stops every one of them and starts cleanly, and stopping it
    leaves no process of either behind. A part killed outright has what it left running stopped before its restart."""
    marker = f"DVI_UP_TEST={uuid.uuid4().hex}"
    port = free_port()
    overrides = [f"model.cache_dir={tmp_path / 'cache'}", f"stream.port={port}", "tracking.enabled=false"]
    env = clean_env(**{marker.split("=")[0]: marker.split("=")[1], "PYTHONUNBUFFERED": "1"})

    def start() -> tuple[subprocess.Popen, Lines]:
        proc = subprocess.Popen([sys.executable, "-m", "dvi.cli", "up", "--only", "broker", *overrides], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        lines = Lines(proc)
        lines.wait_for("Ctrl-C stops everything", 120)
        return proc, lines

    first, _ = start()
    first.kill()  # the supervisor dies at once: no signal reaches its parts
    first.wait(10)
    left = processes_with(marker)
    assert left and _listening(port), "its parts outlive a supervisor killed outright"
    second, out = start()
    try:
        said = next(line for line in out.lines if "stopped what an earlier dvi up left running" in line)
        assert "broker (pid" in said and "tansu (pid" in said, said
        assert not set(left) & set(processes_with(marker)), "every process the first one left is gone"

        # a part killed outright (dvi broker, SIGKILL): its Tansu is stopped before the restart, which then gets the port
        registry = {json.loads(p.read_text())["name"]: json.loads(p.read_text())["pid"]
                    for p in (tmp_path / "cache" / "up.children").glob("*.json")}
        os.kill(registry["broker"], signal.SIGKILL)
        i = out.wait_for("broker exited (status -9)", 30)
        assert "stopped what it left running: tansu (pid" in out.lines[i], out.lines[i]
        out.wait_for("broker ready again", 120, after=i)
    finally:
        os.killpg(second.pid, signal.SIGTERM)
        code = second.wait(60)
    assert code == 0, "\n".join(out.lines)
    time.sleep(0.5)
    assert processes_with(marker) == [], "processes left behind after `dvi up` stopped"
    assert list((tmp_path / "cache" / "up.children").glob("*.json")) == []


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
