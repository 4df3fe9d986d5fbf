"""Scenario 4, MLflow down for half a minute: `dvi serve` and `dvi train` (real processes, the real broker, DeepSpeed)
log to a real MLflow server that is killed while requests flow and the trainer steps, and started again 30 s
later on the same port and store. Serving and training go on; tracking resumes, the points logged during the
outage land in the same runs at their original times, and both processes say what they missed."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import Counter

import pytest
import requests
from broker_fixtures import stream_config
from child_env import clean_env
from faults_helpers import Serve, stream_overrides, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.slow, pytest.mark.broker]

OUTAGE_S = 30.0


@pytest.mark.parametrize("engine", ["dvi"])  # on vLLM with the tiny pair the trainer sees no record in 300 s: open
def test_serving_and_training_go_on_while_mlflow_is_down_and_tracking_catches_up(broker, tiny_dirs, tmp_path, engine):
    from mlflow import MlflowClient

    from dvi.mlflow_server import LocalMlflow
    from dvi.procs import free_port, spawn
    from streams.topics import ensure_topics

    scfg = stream_config(broker.bootstrap)
    ensure_topics(scfg)
    port, root = free_port(), tmp_path / "mlflow"
    experiment = f"outage-{tmp_path.name}"
    common = [*stream_overrides(scfg), f"model.target={tiny_dirs[0]}", f"model.drafter={tiny_dirs[1]}",
              f"tracking.uri=http://127.0.0.1:{port}", f"tracking.experiment={experiment}", "tracking.retry_s=1",
              f"trainer.store={tmp_path / 'store'}"]
    mlflow = LocalMlflow(root, port).start()
    serve = train = None
    try:
        # the trainer starts while the server does (it waits for records), each importing on a core of its own
        train = spawn("train", [sys.executable, "-m", "dvi.cli", "-v", "train", *common, f"trainer.run_dir={tmp_path / 'run'}",
                                "trainer.batch_tokens=64", "trainer.replay_when_idle=true", "trainer.log_every=1",
                                "trainer.checkpoint_every=10", "trainer.gate_every=100000"],
                      log_path=tmp_path / "train.log", env=clean_env())
        serve = Serve(tmp_path, *common, "serve.metrics_every_s=1", "serve.spec.adaptive=false", engine=engine)
        statuses: Counter = Counter()
        stop = threading.Event()

        def traffic():
            i = 0
            while not stop.is_set():
                try:
                    r = requests.post(serve.url + "/v1/completions", json={"prompt": f"Item {i}:", "max_tokens": 8}, timeout=60)
                    statuses[r.status_code] += 1
                except requests.RequestException as e:
                    statuses[type(e).__name__] += 1
                i += 1

        client = threading.Thread(target=traffic, daemon=True)
        client.start()
        steps = lambda: [int(n) for n in re.findall(r"step (\d+): loss", train.log_since_start())]  # noqa: E731
        wait_until(lambda: len(steps()) >= 3, 300, "the trainer steps")
        wait_until(lambda: sum(statuses.values()) >= 3, 120, "requests are answered")

        down_at = time.time()
        mlflow.stop()
        served_before, steps_before = sum(statuses.values()), max(steps())
        time.sleep(OUTAGE_S)
        served_during, steps_during = sum(statuses.values()) - served_before, max(steps()) - steps_before
        up_at = time.time()
        mlflow = LocalMlflow(root, port).start()
        said = re.compile(r"reachable again after \d+ s: (\d+) metric points logged during the outage sent")
        wait_until(lambda: said.search(serve.child.log_since_start()) and said.search(train.log_since_start()), 120,
                   "serve and train report the outage")
        stop.set()
        client.join(90)
        assert serve.child.running and train.running, "a part died during the outage"

        # serving and training went on
        assert set(statuses) == {200}, statuses
        assert served_during >= 5 and steps_during >= 3, (served_during, steps_during)
        # what was logged during the outage landed in the same runs, at its original times
        mc = MlflowClient(mlflow.uri)
        exp = mc.get_experiment_by_name(experiment)
        runs = {r.data.tags.get("dvi.role"): r for r in mc.search_runs([exp.experiment_id])}
        assert {"serve", "trainer"} <= set(runs), runs.keys()
        for role, key in (("serve", "interval/tokens_per_s"), ("trainer", "loss")):
            history = mc.get_metric_history(runs[role].info.run_id, key)
            during = [m for m in history if down_at * 1000 < m.timestamp < up_at * 1000]
            assert during, f"no {role} {key} point from the outage in MLflow"
        backfilled = {name: int(said.search(p.log_since_start()).group(1)) for name, p in (("serve", serve.child), ("train", train))}
        assert all(n > 0 for n in backfilled.values()), backfilled
        print(f"\nMLflow down {up_at - down_at:.0f} s: {served_during} requests answered (all 200), {steps_during} trainer "
              f"steps; points sent once it was back: {backfilled}")
    finally:
        if train is not None:
            train.stop(grace_s=30)
        if serve is not None:
            serve.stop()
        mlflow.stop()
