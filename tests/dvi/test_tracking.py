"""The MLflow sink against a real MLflow server (dvi.mlflow_server.LocalMlflow, SQLite + local artifacts).

One server per module on a free port; each test has an experiment of its own. The outage test starts a second
server late on a port where nothing listened while the tracker was already logging. Waits poll with deadlines.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import stat
import time
import uuid

import pytest

from dvi.config import TrackingConfig
from dvi.errors import DviError
from dvi.mlflow_server import LocalMlflow
from dvi.procs import free_port, port_in_use
from dvi.tracking import Tracker, loop_view, redact


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LocalMlflow(tmp_path_factory.mktemp("mlflow"), free_port()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)


def config(uri: str, **overrides) -> TrackingConfig:
    name = f"t{uuid.uuid4().hex[:8]}"
    args = dict(uri=uri, experiment=name, registry_model=f"{name}-drafter", retry_s=0.2)
    args.update(overrides)
    return TrackingConfig(**args)


def dead_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"


def wait_for(condition, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def history(client, run_id: str, key: str) -> list:
    return sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)


@pytest.mark.slow
def test_metrics_params_and_tags_land_in_the_run(server, client):
    cfg = config(server.uri)
    tracker = Tracker(cfg, "run-a", params={"lr": 3e-4, "trainer": {"zero_stage": 2}}, tags={"dvi.role": "trainer"})
    for step in range(5):
        tracker.log_metrics({"loss": 1.0 / (step + 1), "acceptance": 0.1 * step}, step)
    stats = tracker.close(timeout_s=20)

    assert (stats.sent, stats.queued, stats.dropped, stats.connected) == (10, 0, 0, True)
    run = client.get_run(stats.run_id)
    assert run.info.run_name == "run-a" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == cfg.experiment
    assert run.data.params == {"lr": "0.0003", "trainer.zero_stage": "2"}
    assert run.data.tags["dvi.role"] == "trainer"
    loss = history(client, stats.run_id, "loss")
    assert [m.step for m in loss] == [0, 1, 2, 3, 4]
    assert [m.value for m in loss] == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.2])


@pytest.mark.slow
def test_non_finite_values_are_skipped_and_counted(server, client):
    tracker = Tracker(config(server.uri), "run-nan")
    tracker.log_metrics({"loss": math.nan, "kl": math.inf, "bad": "x", "ok": 1.5}, step=3)
    stats = tracker.close(timeout_s=20)

    assert (stats.skipped_nonfinite, stats.sent, stats.dropped) == (3, 1, 0)
    assert [(m.step, m.value) for m in history(client, stats.run_id, "ok")] == [(3, 1.5)]
    assert client.get_metric_history(stats.run_id, "loss") == []


@pytest.mark.slow
def test_a_metric_name_mlflow_refuses_drops_that_key_alone(server, client):
    """One point with a name MLflow refuses would make it refuse the whole batch: only that point is skipped."""
    tracker = Tracker(config(server.uri), "run-names")
    tracker.log_metrics({"acceptance.code": 0.5, "acceptance.bad!": 0.1, "acceptance..": 0.2, "a" * 300: 0.3}, step=1)
    tracker.log_metrics({"acceptance.code": 0.6}, step=2)
    stats = tracker.close(timeout_s=20)
    assert (stats.skipped_nonfinite, stats.sent, stats.dropped, stats.failures) == (3, 2, 0, 0)
    assert [(m.step, m.value) for m in history(client, stats.run_id, "acceptance.code")] == [(1, 0.5), (2, 0.6)]


def registered(client, name: str) -> dict[str, int]:
    """dvi drafter version -> MLflow model version number, as the registry has them."""
    return {mv.tags["dvi.version"]: int(mv.version) for mv in client.search_model_versions(f"name='{name}'")}


@pytest.mark.slow
def test_register_drafter_creates_a_version_with_alias_and_tags(server, client, tmp_path):
    cfg = config(server.uri)
    tracker = Tracker(cfg, "run-reg")
    for version in ("v1", "v2"):
        store = tmp_path / "store" / version
        store.mkdir(parents=True)
        (store / "model.safetensors").write_bytes(version.encode() * 100)
        tracker.register_drafter(str(store), version, {"parent": "v0", "sha256": "ab" * 32})
    wait_for(lambda: len(registered(client, cfg.registry_model)) == 2, what="two registrations")
    stats = tracker.close(timeout_s=20)

    assert registered(client, cfg.registry_model) == {"v1": 1, "v2": 2}
    mv = client.get_model_version_by_alias(cfg.registry_model, "candidate")
    assert mv.version == "2"  # the alias moved to the latest candidate
    assert mv.run_id == stats.run_id
    assert mv.tags == {"parent": "v0", "sha256": "ab" * 32, "dvi.version": "v2", "dvi.source": str(tmp_path / "store" / "v2")}
    assert mv.source == f"runs:/{stats.run_id}/drafters/v2"
    assert sorted(f.path for f in client.list_artifacts(stats.run_id, "drafters/v2")) == ["drafters/v2/MLmodel", "drafters/v2/model.safetensors"]


@pytest.mark.slow
def test_a_registered_drafter_loads_through_the_registry_as_a_pyfunc_model(server, tiny_dirs, tmp_path, monkeypatch):
    """`mlflow.pyfunc.load_model("models:/<name>@candidate")` gives the drafter, whose predictions are its own
    greedy continuation."""
    import mlflow
    import torch

    from dvi.models import load_drafter, load_tokenizer

    cfg = config(server.uri)
    tracker = Tracker(cfg, "run-pyfunc")
    tracker.register_drafter(str(tiny_dirs[1]), "d0001", {"parent": "init"})
    stats = tracker.close(timeout_s=60)
    assert stats.failures == 0, stats
    # the environment, not mlflow.set_*_uri: those pin a process-wide URI that would outlive this test
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", server.uri)
    model = mlflow.pyfunc.load_model(f"models:/{cfg.registry_model}@candidate")
    prompt = [101, 2045, 330, 7, 88]
    got = model.predict([prompt, "Once upon a time"], params={"max_new_tokens": 5})
    drafter = load_drafter(tiny_dirs[1], 49152)
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(5):
            ids.append(int(drafter.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got[0]["token_ids"] == ids[len(prompt):]
    assert len(got[1]["token_ids"]) == 5 and got[1]["text"] == load_tokenizer(tiny_dirs[0]).decode(got[1]["token_ids"])


@pytest.mark.slow
def test_promotion_moves_the_candidate_alias_off_and_the_experiment_opens_on_its_runs(server, client, tmp_path):
    from dvi.tracking import EXPERIMENT_TAGS, loop_view

    cfg = config(server.uri)
    tracker = Tracker(cfg, "run-promote")
    store = tmp_path / "v1"
    store.mkdir()
    (store / "model.safetensors").write_bytes(b"v1" * 100)
    tracker.register_drafter(str(store), "v1", {"parent_version": "v0"})
    tracker.promote("v1")
    tracker.close(timeout_s=20)
    aliases = client.get_registered_model(cfg.registry_model).aliases
    assert aliases == {"production": "1"}  # the candidate alias left the version the replicas kept
    exp = client.get_experiment_by_name(cfg.experiment)
    assert exp.tags["mlflow.experimentKind"] == EXPERIMENT_TAGS["mlflow.experimentKind"] == "custom_model_development"
    view = loop_view(cfg)  # what `dvi status` reads, over the REST API
    assert view["aliases"] == {"production": "v1"} and view["versions"][0]["tags"]["parent_version"] == "v0", view


@pytest.mark.slow
def test_backlog_after_late_start_and_restart_keeps_run_steps_and_times(tmp_path):
    # MLflow down first as a black hole (connections queue, nothing answers: requests hang), then refusing, then
    # a real server on that port; then that server restarts mid-run
    from mlflow import MlflowClient

    hole = socket.create_server(("127.0.0.1", 0), backlog=16)
    port = hole.getsockname()[1]
    tracker = Tracker(config(f"http://127.0.0.1:{port}", queue_size=50), "run-late", params={"seed": 1})
    stamps, slowest = {}, 0.0
    for step in range(80):
        before = time.time()
        tracker.log_metrics({"loss": float(step)}, step)
        after = time.time()
        slowest = max(slowest, after - before)
        stamps[step] = (int(before * 1000), int(after * 1000) + 1)
    assert slowest < 0.25, f"log_metrics blocked for {slowest:.3f} s with MLflow down"
    stats = tracker.stats()
    assert (stats.connected, stats.run_id, stats.queued, stats.dropped) == (False, None, 50, 30)
    hole.close()  # the hung request fails now; retries are refused until the server is up

    with LocalMlflow(tmp_path / "mlflow", port) as late:
        up = time.time()
        wait_for(lambda: tracker.stats().sent == 50, what="the backlog to arrive")
        run_id = tracker.stats().run_id
        points = history(MlflowClient(tracking_uri=late.uri), run_id, "loss")
        assert [m.step for m in points] == list(range(30, 80))  # the 30 oldest were dropped
        assert all(stamps[m.step][0] <= m.timestamp <= stamps[m.step][1] < up * 1000 for m in points)

    tracker.log_metrics({"loss": 100.0}, 100)
    wait_for(lambda: not tracker.stats().connected, what="the tracker to notice the outage")
    with LocalMlflow(tmp_path / "mlflow", port) as again:
        stats = tracker.close(timeout_s=20)
        assert (stats.run_id, stats.sent, stats.dropped, stats.queued, stats.connected) == (run_id, 51, 30, 0, True)
        client = MlflowClient(tracking_uri=again.uri)
        assert [m.step for m in history(client, run_id, "loss")] == [*range(30, 80), 100]
        run = client.get_run(run_id)
        assert run.data.params == {"seed": "1"} and run.info.status == "FINISHED"
        assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slow
def test_queue_overflow_drops_the_oldest_and_counts():
    tracker = Tracker(config(dead_uri(), queue_size=5, retry_s=30.0), "run-full")
    for step in range(12):
        tracker.log_metrics({"loss": float(step)}, step)
    stats = tracker.stats()
    assert (stats.queued, stats.dropped, stats.sent) == (5, 7, 0)
    assert tracker.close(timeout_s=0.5).dropped == 12


@pytest.mark.slow
def test_close_on_an_unreachable_server_returns_in_time_and_reports_the_loss(caplog):
    tracker = Tracker(config(dead_uri(), retry_s=0.1), "run-dead")
    tracker.register_drafter("/nowhere/v1", "v1", {})
    tracker.log_metrics({"loss": 1.0, "kl": 2.0}, step=0)
    caplog.set_level(logging.WARNING, logger="dvi.tracking")
    start = time.monotonic()
    stats = tracker.close(timeout_s=1.5)
    took = time.monotonic() - start

    assert took < 2.5, f"close took {took:.1f} s with a 1.5 s timeout"
    assert (stats.connected, stats.sent, stats.queued, stats.dropped) == (False, 0, 0, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert any("2 metric points lost" in line for line in lines), lines
    assert any("v1" in line and "not done: registering" in line for line in lines), lines


def test_disabled_tracker_is_a_no_op():
    tracker = Tracker(TrackingConfig(enabled=False), "off")
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.register_drafter("/x", "v1", {})
    assert tracker.close().sent == 0 and tracker.stats().queued == 0


@pytest.mark.slow
def test_local_mlflow_refuses_a_port_in_use(server, tmp_path):
    with pytest.raises(DviError, match=f"port {server.port}.*in use"):
        LocalMlflow(tmp_path, server.port).start()


def test_credentials_in_a_tracking_uri_never_reach_a_log_or_dvi_status(caplog):
    assert redact("http://alice:hunter2@mlflow:5000/api") == "http://***@mlflow:5000/api"
    assert redact("see https://u:p@a/ and http://b/") == "see https://***@a/ and http://b/"
    cfg = config(dead_uri().replace("http://", "http://alice:hunter2@"), retry_s=0.1)
    caplog.set_level(logging.INFO, logger="dvi.tracking")
    tracker = Tracker(cfg, "run-secret")
    tracker.log_metrics({"loss": 1.0}, step=0)
    tracker.close(timeout_s=1.5)
    view = loop_view(cfg)
    assert "error" in view and "hunter2" not in str(view)
    assert caplog.records and not any("hunter2" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_the_experiments_saved_view_charts_the_keys_of_every_run(server, client):
    from dvi import mlflow_view

    cfg = config(server.uri)
    serve = Tracker(cfg, "serve-a")
    serve.log_metrics({"interval/acceptance.code": 0.1, "version/init/acceptance_rate": 0.05, "records/sent": 3}, step=1)
    serve.close(timeout_s=20)
    exp = client.get_experiment_by_name(cfg.experiment)
    first = json.loads(json.loads(exp.tags[mlflow_view.TAG_KEY])["state"])
    assert {k for c in first["compareRunCharts"] for k in c["selectedMetricKeys"]} == {
        "interval/acceptance.code", "version/init/acceptance_rate"}

    trainer = Tracker(cfg, "trainer")  # a later run adds its keys and keeps the first one's
    trainer.log_metrics({"gate/candidate_acceptance": 0.3, "gate/serving_acceptance": 0.2, "loss": 2.0}, step=1)
    trainer.log_metrics({"version/d0001/acceptance_rate": 0.3}, step=2)
    trainer.close(timeout_s=20)
    tags = client.get_experiment(exp.experiment_id).tags
    state = json.loads(json.loads(tags[mlflow_view.TAG_KEY])["state"])
    assert state == mlflow_view.view_state({"interval/acceptance.code", "version/init/acceptance_rate",
                                            "gate/candidate_acceptance", "gate/serving_acceptance", "loss", "version/d0001/acceptance_rate"})


@pytest.mark.slow
def test_a_local_mlflow_with_auth_refuses_anonymous_clients_and_dvi_logs_in_with_the_mlflow_variables(tmp_path, monkeypatch):
    import urllib.error

    from mlflow import MlflowClient

    from dvi.tracking import rest

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "dvi-admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "a-long-secret-9")
    with LocalMlflow(tmp_path / "mlflow", free_port(), auth=True) as s:
        assert "a-long-secret-9" not in (tmp_path / "mlflow" / "basic_auth.ini").read_text()  # the password is in no file
        cfg = config(s.uri)
        tracker = Tracker(cfg, "trainer", tags={"dvi.role": "trainer"})
        tracker.log_metrics({"loss": 1.5}, step=3)
        stats = tracker.close(timeout_s=30)
        assert (stats.sent, stats.dropped) == (1, 0)
        assert [m.value for m in MlflowClient(s.uri).get_metric_history(stats.run_id, "loss")] == [1.5]
        assert loop_view(cfg)["trainer"]["metrics"]["loss"]["value"] == 1.5  # `dvi status` logs in too

        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")  # anonymous: refused, and `dvi status` says why
        with pytest.raises(urllib.error.HTTPError) as refused:
            rest(s.uri, "experiments/get-by-name", {"experiment_name": cfg.experiment})
        assert refused.value.code == 401
        assert "wants a login" in loop_view(cfg)["error"]
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong")
        assert "HTTP 401" in loop_view(cfg)["error"]


@pytest.mark.slow
def test_without_the_variables_the_local_server_makes_a_login_that_every_dvi_part_uses(tmp_path, monkeypatch):
    import urllib.error

    from dvi.mlflow_login import LOGIN_FILE, local_login
    from dvi.tracking import rest

    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    port = free_port()
    cfg = TrackingConfig(root=str(tmp_path / "mlflow"), port=port)
    assert cfg.auth  # the default
    with LocalMlflow(tmp_path / "mlflow", port, auth=True) as s:
        login = tmp_path / "mlflow" / LOGIN_FILE
        assert stat.S_IMODE(login.stat().st_mode) == 0o600
        password = os.environ["MLFLOW_TRACKING_PASSWORD"]
        assert len(password) >= 32 and f"MLFLOW_TRACKING_PASSWORD={password}" in login.read_text()
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")  # another process: it reads the file
        with pytest.raises(urllib.error.HTTPError) as refused:
            rest(s.uri, "experiments/get-by-name", {"experiment_name": "Default"})
        assert refused.value.code == 401
        assert local_login(cfg) == login and local_login(cfg) == login
        assert rest(s.uri, "experiments/get-by-name", {"experiment_name": "Default"})["experiment"]["name"] == "Default"
        tracker = Tracker(cfg, "trainer")
        tracker.log_metrics({"loss": 0.5}, step=1)
        assert tracker.close(timeout_s=30).sent == 1
    # a login that is not the admin account's is one clear error at start, and the server is not left running
    login.write_text(f"MLFLOW_TRACKING_USERNAME=dvi\nMLFLOW_TRACKING_PASSWORD={password}-changed\n")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    with pytest.raises(DviError, match="has another password"):
        LocalMlflow(tmp_path / "mlflow", port, auth=True).start()
    assert not port_in_use(port)
    assert TrackingConfig(uri="http://mlflow:5000").auth and local_login(TrackingConfig(uri="http://mlflow:5000")) is None


def test_a_dvi_process_sends_no_mlflow_telemetry_and_writes_nothing_under_home(tmp_path):
    """MLflow's client starts usage telemetry on import (reports sent out, an installation id written under
    ~/.config) unless MLFLOW_DISABLE_TELEMETRY is set; a process that imports mlflow through dvi has it off. Run in a
    child without the variables that make MLflow skip telemetry by itself (pytest's, CI's)."""
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    skips = {"MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "XDG_CONFIG_HOME", "PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI",
             "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS", "TF_BUILD", "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN",
             "BUILDKITE", "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION", "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME", "RUNBOT_WORKER_ID"}
    env = {k: v for k, v in os.environ.items() if k not in skips}  # mlflow.telemetry.utils: each of these turns it off
    env["HOME"] = str(home)
    probe = ("import dvi.tracking, mlflow\n"
             "from mlflow.telemetry.client import get_telemetry_client\n"
             "print(get_telemetry_client() is None)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stdout + out.stderr
    assert not list(home.rglob("*")), sorted(home.rglob("*"))

    # the reference: without dvi's setting, the same child starts MLflow's telemetry and writes its id under home
    plain = subprocess.run([sys.executable, "-c", probe.replace("import dvi.tracking, mlflow", "import mlflow")],
                           env=env, capture_output=True, text=True, timeout=120, check=True)
    assert plain.stdout.strip().splitlines()[-1] == "False", plain.stdout + plain.stderr
    assert (home / ".config" / "mlflow" / "telemetry.json").is_file()
