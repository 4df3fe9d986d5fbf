"""`dvi up`: the restart backoff and the plan as pure logic; then the real stack (broker, MLflow, serve, train), one
detached start checked from start to stop: asked, its serve killed and restarted, a first drafter published and swapped
in, the README's own `vllm serve` with dvi's plugin run beside it on its broker, and stopped with `dvi down` with no
process left behind (a vLLM start costs minutes on a small CPU: one stack serves all of it)."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import shlex
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
import torch
from child_env import clean_env

from dvi import mlflow_view
from dvi.cli.up import MAX_BACKOFF_S, STABLE_S, PairPrep, Part, Supervisor, next_backoff, plan, stack_priority
from dvi.config import load_config
from dvi.drafters import shipped_version
from dvi.eagle3 import target_features
from dvi.errors import DviError
from dvi.hardware import pick_engine
from dvi.mlflow_login import local_login
from dvi.models import load_causal_lm
from dvi.procs import REGISTRY_ENV, _zombie, free_port, http_ok, spawn, wait_ready
from dvi.tracking import rest
from streams.consumer import DecisionConsumer


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


def test_the_trainer_is_paused_only_where_this_dvi_up_runs_the_server_too():
    paused = load_config(["trainer.cpu_priority=pause"])
    train = {p.name: p for p in plan(paused)}["train"]
    assert stack_priority(paused).value == "pause" and any(a.startswith("stream.session_timeout_ms=") for a in train.args)
    alone = stack_priority(paused, only={"broker", "train"})
    assert alone.value == "normal" and alone.why.endswith("this dvi up runs no server to pause it for")
    assert not any(a.startswith("stream.session_timeout_ms=") for a in plan(paused, only={"train"})[0].args)
    assert stack_priority(paused, train=False) is None and stack_priority(paused, only={"serve"}) is None


def left_after_stop(marker: str, within_s: float = 10.0) -> list[int]:
    """`processes_with(marker)` once they have had `within_s` to exit after what started them stopped: vLLM's engine
    and worker, and multiprocessing's resource tracker cleaning up their shared memory, end moments after it."""
    deadline = time.monotonic() + within_s
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


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
    """What a `dvi up` says, line by line, waited on: its stdout (`proc`, read by a thread) or, for a detached one, its
    log (`path`, <cache>/logs/up.log, read again at each look)."""

    def __init__(self, source: subprocess.Popen | Path):
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._path = source if isinstance(source, Path) else None
        if self._path is None:
            threading.Thread(target=self._read, args=(source,), daemon=True).start()

    def _read(self, proc):
        for line in proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()

    def text(self) -> str:
        if self._path is not None and self._path.exists():
            self.lines = self._path.read_text(errors="replace").splitlines()
        return "\n".join(self.lines)

    def wait_for(self, text: str, timeout_s: float, after: int = 0) -> int:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                self.text()
                for i in range(after, len(self.lines)):
                    if text in self.lines[i]:
                        return i
                left = deadline - time.monotonic()
                assert left > 0, f"no '{text}' within {timeout_s} s:\n" + "\n".join(self.lines)
                self._cv.wait(left if self._path is None else min(left, 0.5))


# a part for the supervision tests: it starts a worker of its own (recorded, as a part's broker or MLflow server is),
# then waits
SLEEPER = "from dvi.procs import spawn; import time; spawn('worker', ['sleep', '600']); time.sleep(600)"


class Sleepers(Supervisor):
    """`dvi up`'s supervision of parts that are SLEEPER processes."""

    def _spawn(self, part: Part):
        return spawn(part.name, [sys.executable, "-c", SLEEPER], log_path=self.log_dir / f"{part.name}.log")


def test_a_part_starts_once_what_it_needs_is_ready_and_beside_the_parts_that_need_the_same(tmp_path, monkeypatch):
    """`Part.needs`: serve and train start together once the infrastructure is ready (a name the supervisor does not
    run is not waited for); a part without `needs` starts once every part before it is ready."""
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "children"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    spawned: dict[str, float] = {}
    takes = {"infra": 1.0, "serve": 2.0, "train": 2.0, "last": 0.5}  # seconds from its start until it says it is ready

    class Timed(Sleepers):
        def _spawn(self, part):
            spawned[part.name] = time.monotonic()
            return super()._spawn(part)

    def probe(name: str):
        return lambda _c: None if time.monotonic() >= spawned[name] + takes[name] else "not yet"

    said: list[str] = []
    sup = Timed([Part("infra", [], probe("infra"), 30), Part("serve", [], probe("serve"), 30, needs=("infra",)),
                 Part("train", [], probe("train"), 30, needs=("infra", "elsewhere")), Part("last", [], probe("last"), 30)],
                [], tmp_path / "logs", say=said.append, relay=False)
    t0 = time.monotonic()
    sup.start()
    try:
        took = time.monotonic() - t0
        assert spawned["serve"] >= spawned["infra"] + takes["infra"] and spawned["train"] >= spawned["infra"] + takes["infra"]
        assert abs(spawned["serve"] - spawned["train"]) < 1.0, spawned  # together, not one after the other
        assert spawned["last"] >= max(spawned["serve"], spawned["train"]) + takes["serve"]
        assert took < sum(takes.values()) - 1.0, (took, said)
        assert [line.split()[2] for line in said if " ready (pid" in line] == ["infra", "serve", "train", "last"], said
    finally:
        sup.stop()
    assert _registry(tmp_path / "children") == []


def test_a_held_part_starts_once_released_and_a_hold_that_fails_stops_what_started(tmp_path, monkeypatch):
    """`Supervisor.start(held=...)`: what `dvi up` does while the model pair is prepared (`PairPrep`). The parts not
    held start at once; a held one once released; a hold that fails (the pair could not be prepared) stops what started
    and is the start's error at once, not once what the held part needs is ready."""
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "children"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    spawned: dict[str, float] = {}

    class Timed(Sleepers):
        def _spawn(self, part):
            spawned[part.name] = time.monotonic()
            return super()._spawn(part)

    parts = [Part("infra", [], lambda _c: None, 30), Part("serve", [], lambda _c: None, 30, needs=("infra",))]
    sup = Timed(parts, [], tmp_path / "logs", say=lambda _line: None, relay=False)
    t0 = time.monotonic()
    sup.start(held=lambda part: part.name == "serve" and time.monotonic() < t0 + 1.5)
    try:
        assert spawned["infra"] < t0 + 1.0 <= t0 + 1.5 <= spawned["serve"], (t0, spawned)
    finally:
        sup.stop()

    def failed(part: Part) -> bool:
        if part.name == "serve" and "infra" in sup.children:
            raise DviError("the model pair could not be prepared (dvi models fetch --pair): no such target")
        return part.name == "serve"

    never = [Part("infra", [], lambda _c: "not yet", 30), parts[1]]  # a broker or MLflow still starting
    sup = Timed(never, [], tmp_path / "logs", say=lambda _line: None, relay=False)
    t0 = time.monotonic()
    with pytest.raises(DviError, match="could not be prepared"):
        sup.start(held=failed)
    assert time.monotonic() - t0 < 10 and not any(child.running for child in sup.children.values())
    assert _registry(tmp_path / "children") == []


def _registry(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in folder.glob("*.json")]


def test_a_pair_that_cannot_be_prepared_is_one_line_naming_the_setting():
    """The child's own check (`dvi models fetch --pair` in a fresh process), its reason carried into dvi up's error."""
    with pytest.raises(DviError, match=r"the model pair could not be prepared \(dvi models fetch --pair\): model\.device=cuda:99"):
        PairPrep(["model.device=cuda:99"]).wait()


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


README = Path(__file__).resolve().parents[3] / "README.md"
PLUGIN_SECTION = "**Keep your vLLM server.**"  # the README section whose command starts vLLM's server with dvi's loop


def readme_command(section: str) -> str:
    """The first ```bash block after `section` in README.md, as it stands there."""
    text = README.read_text()
    start = text.index("```bash\n", text.index(section)) + len("```bash\n")
    return text[start : text.index("\n```", start)]


def substituted(command: str, changes: dict[str, str]) -> str:
    """`command` with each key, which must stand in it once, replaced by its value."""
    for old, new in changes.items():
        assert command.count(old) == 1, f"the README's command does not hold {old!r} once:\n{command}"
        command = command.replace(old, new)
    return command


class ReadmeServer:
    """vLLM's own server with dvi's plugin, started by the README's command (PLUGIN_SECTION) run with bash as written,
    but for what a test must change: HOME (a folder whose .cache/dvi/models links the demo target and EAGLE-3 drafter
    under the names the README uses), the README's `.venv/bin/python` (this interpreter), its broker (the stack's) and
    its fixed ports (free ones: a fixed port clashes with any other run on the machine)."""

    def __init__(self, tmp_path: Path, target: Path, drafter: Path, bootstrap: str, marker: dict[str, str]):
        models = tmp_path / "home" / ".cache" / "dvi" / "models"
        models.mkdir(parents=True)
        for model in (target, drafter):
            (models / model.name).symlink_to(model)
        self.port, loop_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = substituted(readme_command(PLUGIN_SECTION), {
            ".venv/bin/python": shlex.quote(sys.executable), "127.0.0.1:19092": bootstrap,
            "--port 8001": f"--port {self.port}", "DVI_LOOP_PORT=8101": f"DVI_LOOP_PORT={loop_port}"})
        # outside the checkout, as a user's own server runs: a stale dvi.egg-info there would hide the installed entry points
        self.child = spawn("readme-vllm", ["bash", "-c", self.command], log_path=tmp_path / "readme-vllm.log",
                           env=clean_env(HOME=str(tmp_path / "home"), **marker), cwd=tmp_path)

    def health(self) -> dict:
        return requests.get(self.url + "/dvi/health", timeout=10).json()


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)


@contextlib.contextmanager
def adopting_orphans():
    """While inside, a process orphaned below this one becomes its child (Linux's child subreaper), as the background
    `dvi up` of `dvi up --detach` does when that returns: its exit status can then be waited for (`exit_status`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def exit_status(pid: int, timeout_s: float) -> int | None:
    """The exit status of this process's child `pid` (negative: the signal that killed it), or None while it runs."""
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return os.waitstatus_to_exitcode(done[1])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.real_model
@pytest.mark.broker
def test_detached_stack_answers_restarts_a_killed_serve_swaps_in_a_first_drafter_feeds_the_readme_vllm_server_and_stops(
        demo_target_dir, demo_eagle3_dir, demo_bootstrap_dir, tmp_path, monkeypatch):
    """One `dvi up` stack, the default engine (vLLM's server, compiled) and drafter kind (EAGLE-3, untrained: the shipped
    bootstrap drafter would put the first publish this test waits for minutes away), checked from start to stop.

    `dvi up --detach` returns once ready, its supervisor never having loaded torch; a second `dvi up` on the same ports
    refuses. The stack answers with its configured drafter, as `dvi status --json` says; its serve killed (a crash), the
    supervisor reports it, starts it again and it answers as before. README-style chat requests get a first published
    drafter that the replica swaps in; the decision lines reach up.log (dvi up's terminal) with timestamps; `dvi status`
    and MLflow say it. The trainer holds no copy of the target and trains on the features vLLM's server sends with the
    records. Beside the stack, the README's own `vllm serve` with dvi's plugin (ReadmeServer) answers, shows the request
    in its loop's view and sends its records to the stack's broker, and stops on Ctrl-C. `dvi down` stops the parts in
    order, the supervisor exits with status 0, and no process is left behind."""
    marker, readme_marker = f"DVI_UP_TEST={uuid.uuid4().hex}", uuid.uuid4().hex
    api, mlflow_port = free_port(), free_port()
    cache = tmp_path / "cache"
    overrides = [
        f"model.target={demo_target_dir}", f"model.drafter={demo_eagle3_dir}", f"model.cache_dir={cache}",
        f"stream.port={free_port()}", f"tracking.port={mlflow_port}", f"tracking.root={tmp_path / 'mlflow'}", f"serve.port={api}",
        # a gate every 15 s that any gain passes: the defaults (60 s, a gain of 0.02) publish within minutes
        # (benchmarks/first_publish.py measures them); this test is about the publish, the swap and what says so
        "trainer.gate_every_s=15", "trainer.min_gain=0", "serve.metrics_every_s=5",
    ]  # fmt: skip
    cfg = load_config(overrides)
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # the stack makes its own MLflow login
        monkeypatch.delenv(name, raising=False)
    env = clean_env(**{marker.split("=")[0]: marker.split("=")[1], "PYTHONUNBUFFERED": "1"})
    cli = [sys.executable, "-m", "dvi.cli"]
    up_log = Lines(cache / "logs" / "up.log")
    supervisor, readme = None, None
    try:
        # the README's server first: a first vLLM start with its settings compiles (minutes on 2 cores), beside the
        # stack's start and everything below; its loop's records wait in its queue until the stack's broker answers
        readme = ReadmeServer(tmp_path, demo_target_dir, demo_bootstrap_dir, cfg.stream.bootstrap, {"DVI_README_TEST": readme_marker})
        with adopting_orphans():  # the background `dvi up` becomes this process's child: its exit status is checked
            up = subprocess.run([*cli, "up", "--detach", *overrides], capture_output=True, text=True, env=env, timeout=900)
        assert up.returncode == 0 and "Ctrl-C stops everything" in up.stdout and "detached (pid" in up.stdout, up.stdout + up.stderr
        supervisor = int(up.stdout.split("detached (pid ")[1].split(")")[0])
        assert f"API     http://127.0.0.1:{api}/v1" in up.stdout, up.stdout
        # the supervisor itself never loads torch (the pair is prepared in a child: dvi.cli.up.PairPrep)
        assert "libtorch" not in Path(f"/proc/{supervisor}/maps").read_text()
        for part in ("broker", "mlflow", "serve", "train"):
            assert (cache / "logs" / f"{part}.log").exists()
        again = subprocess.run([*cli, "up", *overrides], capture_output=True, text=True, env=env, timeout=120)
        assert again.returncode == 2 and "already running" in again.stderr, again.stderr

        def ask() -> dict:
            r = requests.post(f"http://127.0.0.1:{api}/v1/completions", json={"model": demo_target_dir.name, "prompt": "The capital "
                                                                              "of France is", "max_tokens": 8, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        # the default engine: vLLM's own server with dvi's loop as its plugin, its view at /dvi/health
        assert pick_engine("auto").value == "vllm-server"
        first = ask()
        assert first["usage"]["completion_tokens"] == 8
        serving = requests.get(f"http://127.0.0.1:{api}/dvi/health", timeout=10).json()
        assert serving["drafter_version"] == "init-eagle3-v8192" and serving["requests"] >= 1
        status = subprocess.run([*cli, "status", "--json", *overrides], capture_output=True, text=True, env=env, timeout=120)
        assert status.returncode == 0, status.stderr
        view = json.loads(status.stdout)
        assert view["replicas"][0]["status"] == "ok" and view["replicas"][0]["drafter_version"] == serving["drafter_version"]
        assert view["mlflow"]["uri"] == f"http://127.0.0.1:{mlflow_port}" and "error" not in view["mlflow"], view

        # a crash, before anything is published (the restarted serve decodes with the same drafter): the supervisor
        # reports it and starts serve again
        os.kill(serving["server_pid"], signal.SIGKILL)  # the process dvi up started (vLLM's API server)
        i = up_log.wait_for("serve exited (status -9)", 30)
        up_log.wait_for("serve ready again", 300, after=i)
        assert ask()["choices"][0]["text"] == first["choices"][0]["text"]
        assert processes_with(marker), "the stack's processes carry the marker"

        # the stack's traffic leads to a first publish: requests until the replica swaps it in (however many the trainer,
        # taking its turns beside serving, needs: a short batch steps at its share of the learning rate)
        prompts = ["Write a Python function that reverses a string.", "Write a short paragraph about the sea at night."]
        deadline = time.monotonic() + 900
        for i in itertools.count():
            r = requests.post(f"http://127.0.0.1:{api}/v1/chat/completions", timeout=300, json={
                "model": demo_target_dir.name, "messages": [{"role": "user", "content": prompts[i % 2]}], "max_tokens": 32,
                "vllm_xargs": {"dvi_domain": ("code", "prose")[i % 2]}})  # vLLM's server: the domain tag in vllm_xargs
            assert r.status_code == 200, r.text
            if " swapped in (was " in up_log.text() or time.monotonic() > deadline:
                break
        text = up_log.text()
        # the trainer said what it trains (at the untrained drafter's lr: trainer.lr=auto), and that the features come
        # from the records alone (it loaded no target)
        assert "training an EAGLE-3 drafter at lr 0.0003, precision " in text and "features from records, gate rule" in text, text[-4000:]
        decisions = [line for line in text.splitlines() if " dvi.decision." in line]
        assert any(line.startswith("[train] 20") and " published (parent " in line for line in decisions), text[-4000:]
        assert any(line.startswith("[serve] 20") and " swapped in (was " in line for line in decisions), text[-4000:]
        assert any("gate at step" in line and ": passed: candidate" in line for line in decisions), decisions

        # the features vLLM's server sent with its records are the target's own aux hidden states (Hugging Face's, to
        # the rounding of vLLM's bf16), for the positions each record says
        with DecisionConsumer(cfg.stream, group_id=None, dead_letter=False) as consumer:
            deadline, carried = time.monotonic() + 60, None
            while carried is None:
                assert time.monotonic() < deadline, f"no record with features on {cfg.stream.topic}"
                carried = next((d.record for d in consumer.poll(1.0) if d.record.features is not None), None)
        f, target = carried.features, load_causal_lm(demo_target_dir, "target")
        rows = f.tensor().float()
        sequence = [*carried.prompt_ids, *carried.prefix_ids, *carried.generated_ids][: f.start + len(rows)]
        own = target_features(target, torch.tensor([sequence]), f.layers)[0, f.start:]
        cos = torch.nn.functional.cosine_similarity(rows.unflatten(-1, (len(f.layers), -1)), own.unflatten(-1, (len(f.layers), -1)), dim=-1)
        assert own.shape == rows.shape and cos.min() > 0.98, (f.layers, f.start, own.shape, rows.shape, cos.min())

        t0 = time.monotonic()
        status = subprocess.run([*cli, "status", *overrides], capture_output=True, text=True, env=env, timeout=60)
        took = time.monotonic() - t0
        assert status.returncode == 0, status.stderr
        assert "published: 1 versions, newest d0001" in status.stdout or "published: 2 versions" in status.stdout, status.stdout
        assert "None" not in status.stdout and "last gate at step" in status.stdout, status.stdout
        print(f"dvi status answered in {took:.2f} s:\n{status.stdout}")
        # each version's requests timed against target-only decoding on their own steps, in all and by domain
        speeds = requests.get(f"http://127.0.0.1:{api}/dvi/health", timeout=10).json()["vs_target_only_by_version"]
        assert speeds and all(0 < s["all"] < 10 and set(s["by_domain"]) <= {"none", "code", "prose"} for s in speeds.values()), speeds
        assert any({"code", "prose"} & set(s["by_domain"]) for s in speeds.values()), speeds
        assert "requests' speed over target-only decoding by version: " in status.stdout, status.stdout
        assert "- (no request timed yet" not in status.stdout, status.stdout

        # MLflow asks for a login, the one in the file `dvi up` names; the serve run's name is the same across restarts
        # (one run name for the serve started twice), and the link dvi prints opens the saved view
        uri = f"http://127.0.0.1:{mlflow_port}"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            rest(uri, "experiments/get-by-name", {"experiment_name": "dvi"})
        login = local_login(cfg.tracking)
        assert login == tmp_path / "mlflow" / "login.env" and f"login: user and password in {login}" in up.stdout, up.stdout
        exp = rest(uri, "experiments/get-by-name", {"experiment_name": "dvi"})["experiment"]
        assert f"mlflow: {uri}/#/experiments/{exp['experiment_id']}/runs?viewStateShareKey=dvi" in status.stdout, status.stdout
        runs = rest(uri, "runs/search", body={"experiment_ids": [exp["experiment_id"]]})["runs"]
        assert {r["info"]["run_name"] for r in runs} == {"trainer", f"serve-{socket.gethostname()}-{api}"}, runs
        view = json.loads(json.loads({t["key"]: t["value"] for t in exp["tags"]}[mlflow_view.TAG_KEY])["state"])
        assert view["compareRunCharts"] and view["selectedColumns"] == mlflow_view.view_state([])["selectedColumns"], view

        # the README's server: it answers, its loop's view on its port shows the request, its records reach the stack's topic
        wait_ready(readme.child, lambda: http_ok(readme.url + "/health"), 600, "the README's vllm serve", interval_s=0.5)
        chat = requests.post(readme.url + "/v1/chat/completions", timeout=300, json={
            "model": demo_target_dir.name, "messages": [{"role": "user", "content": "Name three primary colors."}], "max_tokens": 16})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"], chat.text
        deadline = time.monotonic() + 60
        while (h := readme.health())["requests"] < 1 or h["records"]["sent"] < 1:
            assert time.monotonic() < deadline, h
            time.sleep(0.5)
        assert h["drafter_version"] == shipped_version() and h["engine"] == "vllm", h  # the README's: dvi up's default
        # vLLM's CPU build cannot load the ahead-of-time artifact it saves: the plugin turned it off (a second start reuses
        # the compile cache instead of compiling again)
        said = readme.child.log_since_start()
        assert "dvi's loop sets VLLM_USE_AOT_COMPILE=0" in said and "saved AOT compiled function" not in said, said[-3000:]
        with DecisionConsumer(cfg.stream, group_id=None, dead_letter=False) as consumer:
            deadline = time.monotonic() + 120
            while not any(d.record.replica_id == h["replica_id"] and d.record.request_id.startswith(chat.json()["id"])
                          for d in consumer.poll(1.0)):
                assert time.monotonic() < deadline, f"no record of {chat.json()['id']} from {h['replica_id']} on {cfg.stream.topic}"
        stopped = readme.child.stop(signal.SIGINT, grace_s=60)  # Ctrl-C in the terminal it runs in
        assert stopped == 0, readme.child.log_tail(3000)
        assert left_after_stop(f"DVI_README_TEST={readme_marker}") == [], "the README's server left processes behind"
    finally:
        if readme is not None:
            readme.child.stop(grace_s=30)
        down = subprocess.run([*cli, "down", *overrides], capture_output=True, text=True, env=env, timeout=300)
        code = exit_status(supervisor, 60) if supervisor is not None else None
    assert down.returncode == 0 and "stopped dvi up" in down.stdout, down.stdout + down.stderr
    assert code == 0, up_log.text()[-4000:]
    assert left_after_stop(marker) == [], "processes left behind after `dvi down`"
    stopped = [line for line in up_log.text().splitlines() if line.startswith("dvi up:") and " stopped (status" in line]
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
    assert left_after_stop(marker) == [], "processes left behind after `dvi up` stopped"
    assert list((tmp_path / "cache" / "up.children").glob("*.json")) == []


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
