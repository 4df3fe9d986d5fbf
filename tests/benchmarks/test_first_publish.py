"""benchmarks.first_publish's report: each request against the peer's answer to the same prompt, per drafter version,
per phase and per two minutes from the first request (pure: a run as `session` returns it)."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from benchmarks.first_publish import positions_per_s, report, trainer_positions


def run_of(rows: list[dict], lines=()) -> dict:
    return {"rows": rows, "lines": list(lines), "ready": 1000.0, "first": 1010.0, "ready_s": 60.0, "trainer": {}, "banner": []}


def row(i: int, t: float, s: float, version: str, phase: str = "continuous", drafted: int = 10, accepted: int = 5) -> dict:
    return {"i": i, "t": t, "phase": phase, "domain": "code", "versions": [version], "drafted": drafted,
            "accepted": accepted, "s": s, "tokens": 48}


def test_each_request_is_held_to_the_peers_answer_to_the_same_prompt():
    rows = [row(0, 0.0, 2.0, "a"), row(1, 100.0, 4.0, "a"), row(2, 130.0, 1.0, "b", "paced"), row(3, 700.0, 1.5, "b", "paced")]
    peer = [{"s": 2.0, "tokens": 48}, {"s": 2.0, "tokens": 48}, {"s": 2.0, "tokens": 48}, {"s": 1.0, "tokens": 48}]
    lines = [(1010.0 + 120, "[train] ... d0001 published (parent a, step 3)")]
    r = report(run_of(rows, lines), peer, "vLLM")
    assert r["by_version"]["a"]["latency_vs_peer"] == pytest.approx(1.5)  # 1.0 and 2.0
    assert r["by_version"]["b"]["latency_vs_peer"] == pytest.approx(1.0)  # 0.5 and 1.5
    assert r["by_phase"]["paced"]["requests"] == 2 and r["by_phase"]["continuous"]["acceptance"] == 0.5
    assert r["by_minutes"]["0-2"]["requests"] == 2 and r["by_minutes"]["2-4"]["latency_vs_peer"] == pytest.approx(0.5)
    assert r["by_minutes"]["10-12"]["latency_vs_peer"] == pytest.approx(1.5) and r["by_minutes"]["4-6"]["requests"] == 0
    assert r["first_publish"] == {"minutes": 2.17, "requests": 2} and r["peer_speed"]["latency_s"] == 2.0


def test_a_request_the_peer_did_not_answer_has_no_ratio():
    r = report(run_of([row(0, 0.0, 2.0, "a"), row(1, 10.0, 3.0, "a")]), [{"s": 4.0, "tokens": 48}], "vLLM")
    assert r["by_version"]["a"]["latency_vs_peer"] == pytest.approx(0.5) and r["by_version"]["a"]["requests"] == 2


def test_the_trainers_positions_a_second_are_read_from_its_counts_in_the_stacks_mlflow_store(tmp_path):
    store = tmp_path / "mlflow.db"
    assert trainer_positions(store) == []  # no MLflow yet
    with closing(sqlite3.connect(store)) as db:  # the columns trainer_positions reads of MLflow's metrics table
        db.execute("CREATE TABLE metrics (key TEXT, value REAL, timestamp INTEGER, step INTEGER)")
        db.executemany("INSERT INTO metrics VALUES (?, ?, ?, ?)", [("count/positions", 480.0, 10_000, 1),
                       ("positions_per_s", 99.0, 10_500, 2), ("count/positions", 992.0, 12_000, 2), ("count/positions", 1500.0, 20_000, 3)])
        db.commit()
    history = trainer_positions(store)
    assert history == [(10.0, 480.0), (12.0, 992.0), (20.0, 1500.0)]
    assert positions_per_s(history, 5.0, 15.0) == 99.2  # 0 before the first step, 992 at 15 s
    assert positions_per_s(history, 12.0, 22.0) == 50.8 and positions_per_s(history, 3.0, 3.0) is None
