"""The drift benchmark end to end, CI-sized (`python -m benchmarks.drift --quick`: code -> prose, a few minutes): the real
broker, a real MLflow server, DeepSpeed distillation and the real demo pair, through the HTTP API of three
replicas. With the loop on, acceptance on the shifted domain rises; with it off (the frozen replica, same prompts,
same moments) it does not."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
from child_env import run_to_end
from mlflow import MlflowClient

from benchmarks.drift import QUICK
from dvi.mlflow_server import LocalMlflow
from dvi.procs import free_port

REPO = Path(__file__).resolve().parents[2]  # `python -m benchmarks.drift` runs from the checkout root

# the long lane (`pytest -m long`): 13 to 15 minutes on a 2-core AVX2 CPU, at or past the 15-minute limit per test
pytestmark = [pytest.mark.slow, pytest.mark.broker, pytest.mark.real_model, pytest.mark.e2e, pytest.mark.long]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with LocalMlflow(tmp_path_factory.mktemp("mlflow"), free_port()) as s:
        yield s


@pytest.mark.timeout(30 * 60)  # past the run's own 25 minutes and its stop: a run too slow fails with its output
def test_quick_drift_run_wins_back_acceptance_on_the_shifted_domain(broker, mlflow_server, demo_target_dir, tmp_path):
    name = uuid.uuid4().hex[:8]
    out = tmp_path / "drift"
    cmd = [sys.executable, "-m", "benchmarks.drift", "--quick", "--out", str(out),
           f"stream.bootstrap_servers={broker.bootstrap}", f"tracking.uri={mlflow_server.uri}",
           f"tracking.experiment=drift-{name}", f"tracking.registry_model=drafter-{name}",
           "model.drafter=init"]  # the loop's rise from an untrained drafter: the shipped one starts near its ceiling
    done = run_to_end(cmd, 1500, cwd=REPO)
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted((out / "logs").glob("*.log")))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    print(done.stdout)

    summary = json.loads((out / "summary.json").read_text())
    code, prose = summary["phases"]
    assert code["domain"] == "code" and prose["domain"] == "prose"
    assert prose["online_rounds"] >= QUICK["rounds"] and code["online_rounds"] >= QUICK["first_rounds"]  # the budgets were served
    # the loop published, and the online replica swapped the new drafter in while prose traffic flowed
    assert any(s["phase"] == 1 for s in summary["swaps"]), summary["swaps"]
    assert len(prose["versions"]) >= 2
    # same prompts at the same moments on both replicas: the difference of differences cancels prompt difficulty
    online_rise = prose["late_online_acceptance"] - prose["early_online_acceptance"]
    frozen_rise = prose["late_frozen_acceptance"] - prose["early_frozen_acceptance"]
    print(f"prose acceptance, first third -> last third: online {prose['early_online_acceptance']:.3f} -> "
          f"{prose['late_online_acceptance']:.3f}, frozen {prose['early_frozen_acceptance']:.3f} -> "
          f"{prose['late_frozen_acceptance']:.3f}")
    assert online_rise > 0.02, "acceptance on the shifted domain did not rise with the loop on"
    assert online_rise > frozen_rise + 0.02, "the online drafter did not gain on the frozen one"
    assert prose["late_online_acceptance"] > prose["late_frozen_acceptance"]

    # MLflow: the run with its series and artifacts; the registry holds the bootstrap and the online versions
    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name(f"drift-{name}")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`dvi.role` = 'bench'")
    assert len(runs) == 1
    run = runs[0]
    assert len(client.get_metric_history(run.info.run_id, "online/acceptance")) >= 10
    assert len(client.get_metric_history(run.info.run_id, "frozen/acceptance")) >= 10
    assert {a.path for a in client.list_artifacts(run.info.run_id, "drift")} >= {
        "drift/drift.png", "drift/summary.md", "drift/summary.json", "drift/samples.jsonl"}
    versions = client.search_model_versions(f"name='drafter-{name}'")
    assert len(versions) >= 2
    assert (out / "drift.png").stat().st_size > 10_000
