"""`dvi status`: its lines from a replica's /health and MLflow's answers (pure formatting over plain dicts), and
that it loads neither torch nor the mlflow package (what makes it answer in well under 2 s; the real stack's
answer is checked in tests/dvi/cli/test_up.py)."""

from __future__ import annotations

import subprocess
import sys
import time

from dvi.cli.status import drafted_acceptance, publish_lines, replica_lines, trainer_lines


def test_acceptance_counts_drafted_tokens_only_and_unknowns_print_as_dashes():
    health = {"status": "ok", "url": "http://127.0.0.1:8000", "replica_id": "r1", "drafter_version": "d0001", "rollout": "d0001",
              "requests": 50, "median_tokens_per_s": None, "queue_depth": 0, "records": None, "mean_accepted_length": 1.4,
              "by_version": {"init": {"drafted": 900, "accepted": 18, "rounds": 1000}, "d0001": {"drafted": 100, "accepted": 35, "rounds": 100}},
              "events": {"swap": 1}, "vs_target_only": {"8": 0.91, "1": 1.234}}
    assert drafted_acceptance(health["by_version"]) == (53 / 1000, 1000)
    text = "\n".join(replica_lines(health))
    assert "acceptance 0.053 over 1000 drafted tokens (by version: init 0.020, d0001 0.350)" in text
    assert "drafter d0001 (on trial)" in text and "median -" in text and "records sent/dropped -/-" in text
    assert "None" not in text and "swaps 1, promotions 0" in text
    assert "speed over target-only decoding: 1.23x at batch <= 1, 0.91x at batch <= 8" in text
    assert "speed over target-only decoding: - (not measured yet" in "\n".join(replica_lines({**health, "vs_target_only": {}}))
    assert "requests' speed over target-only decoding by version: - (no request timed yet" in text
    assert "trainer's turns" not in text  # no pause policy: no line
    turns = "\n".join(replica_lines({**health, "uptime_s": 600.0, "trainer_turns": {"turns": 41, "waited_s": 36.5}}))
    assert "waited for the trainer's turns on the CPU: 41 turns, 36.5 s (6.1% of its 10.0 min up)" in turns
    by_version = {"init": {"all": 0.97, "by_domain": {}}, "d0001": {"all": 1.31, "by_domain": {"code": 1.52, "prose": 1.1}}}
    assert ("requests' speed over target-only decoding by version: init 0.97x; d0001 1.31x (code 1.52x, prose 1.10x)"
            in "\n".join(replica_lines({**health, "vs_target_only_by_version": by_version})))


def test_trainer_and_publish_lines_say_the_last_and_next_gate_and_why_nothing_is_published():
    now = time.time()

    def m(value, step=12, t=now - 30):
        return {"value": value, "step": step, "time": t}

    waiting = {"trainer": {"run_id": "abc", "run_name": "trainer", "status": "RUNNING",
                           "metrics": {"count/records": m(9), "holdout/records": m(2), "holdout/needed": m(4),
                                       "gate/next_in_s": m(50.0), "gate/next_step": m(50)}}}
    text = "\n".join(trainer_lines(waiting) + publish_lines(waiting))
    assert "run trainer (running), step 12, 9 records" in text and "loss -" in text
    assert "no gate has run yet; next gate in 20 s or at step 50" in text
    assert "published: none yet: the gate waits for held-out records: 2 of 4" in text
    assert "busy time" not in text  # no pause policy: no claim
    waiting["trainer"]["metrics"]["trigger/busy_share"] = m(0.025)  # its candidates refused: it claims less
    assert "retrain requests -, claims 2.5% of serving's busy time" in trainer_lines(waiting)[0]

    gated = {"trainer": {"run_id": "abc", "run_name": "trainer", "status": "RUNNING",
                         "metrics": {"gate/candidate_acceptance": m(0.08, step=20), "gate/serving_acceptance": m(0.03, step=20),
                                     "gate/passed": m(1.0, step=20), "gate/holdout_records": m(4, step=20)}}},
    gated = gated[0] | {"versions": [{"version": "d0001", "number": 1, "created": now - 60, "tags": {
        "parent_version": "init", "records_trained": "11", "gate.serving_acceptance": "0.03", "gate.candidate_acceptance": "0.08"}}],
                         "aliases": {"candidate": "d0001"}}
    text = "\n".join(trainer_lines(gated) + publish_lines(gated))
    assert "last gate at step 20 30 s ago: passed, candidate 0.0800 vs serving 0.0300 on 4 held-out records" in text
    assert "bootstrap's held-out slice" not in text  # no slice kept (trainer.anchor none, or not the shipped drafter)
    gated["trainer"]["metrics"] |= {"gate/anchor_acceptance": m(0.6012, step=20), "gate/anchor_start": m(0.6113, step=20)}
    assert ("passed, candidate 0.0800 vs serving 0.0300 on 4 held-out records, on the bootstrap's held-out slice 0.6012 "
            "(the starting drafter's 0.6113); next gate") in "\n".join(trainer_lines(gated))
    assert "published: 1 versions, newest d0001 (60 s ago, parent init, 11 records trained, gate 0.0300 -> 0.0800); aliases candidate=d0001" in text


def test_status_loads_neither_torch_nor_mlflow():
    code = "import sys, dvi.cli.status; print(sorted(m for m in ('torch', 'mlflow', 'transformers') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
