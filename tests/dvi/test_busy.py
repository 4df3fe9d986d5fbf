"""The busy files by which serving says it has requests in flight, `dvi up`'s hold on its trainer while it has, and the
trainer's turns on the CPU, which serving waits through between two steps."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from dvi import busy
from dvi.cli.up import DutyCycle, Hold, HoldWhileBusy
from dvi.errors import DviError
from dvi.procs import spawn
from dvi.serving.api import ApiError, ClientSlots


def test_a_busy_file_says_whether_its_process_has_requests_in_flight(tmp_path):
    assert not busy.busy(tmp_path / "none")  # no directory: nobody is busy
    mine = busy.BusyFile(tmp_path / "b")
    assert mine.path.name.endswith(".busy") and mine.path.read_bytes() == b"0" and not busy.busy(tmp_path / "b")
    mine.set(True)
    assert busy.busy(tmp_path / "b")
    mine.set(False)
    assert not busy.busy(tmp_path / "b")
    # a process that is gone (its pid taken by nobody) and files of other names never count
    (tmp_path / "b" / "999999999.busy").write_bytes(b"1")
    (tmp_path / "b" / "notes.busy").write_bytes(b"1")
    (tmp_path / "b" / "1.txt").write_bytes(b"1")
    assert not busy.busy(tmp_path / "b")


def test_an_idle_file_says_whether_the_part_has_nothing_to_do(tmp_path):
    assert not busy.idle(tmp_path / "none")  # no directory: nobody said so
    mine = busy.IdleFile(tmp_path)
    assert mine.path.name.endswith(".idle") and mine.path.read_bytes() == b"0" and not busy.idle(tmp_path)
    busy.BusyFile(tmp_path).set(True)  # a busy file is not an idle file
    mine.set(True)
    assert busy.idle(tmp_path)
    (tmp_path / "999999999.idle").write_bytes(b"0")  # a process that is gone never counts
    assert busy.idle(tmp_path)
    (tmp_path / f"{os.getppid()}.idle").write_bytes(b"0")  # another live rank still has work: not idle
    assert not busy.idle(tmp_path)
    (tmp_path / f"{os.getppid()}.idle").write_bytes(b"1")
    assert busy.idle(tmp_path)
    mine.set(False)
    assert not busy.idle(tmp_path)
    # the trainer's side: its idle file, and whether the supervisor's turn file is there (serving waits for it)
    taker = busy.TurnTaker(tmp_path / "t")
    assert not taker.has_turn() and not busy.idle(tmp_path / "t")
    taker.idle(True)
    assert busy.idle(tmp_path / "t")
    turn = busy.Turn(tmp_path / "t")
    turn.give(True)
    assert taker.has_turn()
    turn.give(False)
    assert not taker.has_turn()


def test_serving_is_stepping_while_a_request_is_in_flight_and_no_trainer_has_its_turn(tmp_path):
    assert not busy.Serving(tmp_path / "missing", every_s=0.0)(0.0)  # no directory: nothing in flight
    (tmp_path / "file").write_text("")
    assert not busy.Serving(tmp_path / "file", every_s=0.0)(0.0)  # not a directory: raises nothing
    serving = busy.Serving(tmp_path, every_s=0.0)
    assert not serving(0.0)  # nothing in flight
    mine = busy.BusyFile(tmp_path)
    mine.set(True)
    assert serving(1.0)
    turn = busy.Turn(tmp_path)
    turn.give(True)  # the trainer's turn: serving waits between steps
    assert not serving(2.0)
    turn.give(False)
    assert serving(3.0)
    (tmp_path / busy.TURN).write_text("999999999\n")  # a turn file whose supervisor is gone never counts
    assert serving(4.0)
    mine.set(False)
    assert not serving(5.0)
    # looked at once every every_s at most: asked again within it, the last answer
    cached = busy.Serving(tmp_path, every_s=10.0)
    assert not cached(0.0)
    mine.set(True)
    assert not cached(5.0) and cached(10.0)


def test_client_slots_mark_the_process_busy_while_any_client_has_a_request(tmp_path, monkeypatch):
    monkeypatch.setenv(busy.ENV, str(tmp_path))
    slots = ClientSlots(1, busy.BusyFile.from_env())
    first = slots.take("a")
    second = slots.take("b")
    assert busy.busy(tmp_path)
    with pytest.raises(ApiError):  # refused: nothing changes
        slots.take("a")
    first()
    first()  # once, however often
    assert busy.busy(tmp_path)
    second()
    assert not busy.busy(tmp_path) and not slots.inflight
    monkeypatch.delenv(busy.ENV)
    assert busy.BusyFile.from_env() is None and ClientSlots(0).busy is None


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_for(pid: int, want: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (got := state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_the_trainer_is_stopped_while_serving_is_busy_and_goes_on_after(tmp_path):
    child = spawn("train", [sys.executable, "-c", "import time; time.sleep(120)"], log_path=tmp_path / "train.log")
    supervisor = SimpleNamespace(children={"train": child}, restarting=lambda name: False)
    serving = busy.BusyFile(tmp_path / "busy")
    watch = HoldWhileBusy(Hold(supervisor, "train"), tmp_path / "busy", every_s=0.01)
    watch.start()
    try:
        assert wait_for(child.pid, "S") == "S"  # not busy: it runs (asleep in its own sleep)
        serving.set(True)
        assert wait_for(child.pid, "T") == "T"  # stopped
        serving.set(False)
        assert wait_for(child.pid, "S") == "S"
        serving.set(True)
        assert wait_for(child.pid, "T") == "T"
        watch.close()  # the watch ends with the part going on, busy or not
        assert wait_for(child.pid, "S") == "S" and watch.hold.held_s > 0 and watch.hold.held_pid is None
        # a new launch (a restart) is stopped on its own; the old one is not signalled again
        hold = Hold(supervisor, "train")
        hold.set(True)
        assert wait_for(child.pid, "T") == "T"
        hold.set(True)
        hold.set(False)
        assert wait_for(child.pid, "S") == "S"
        starting = Hold(SimpleNamespace(children={"train": child}, restarting=lambda name: True), "train")
        starting.set(True)  # a restarted launch not ready yet: left to start
        time.sleep(0.1)
        assert state(child.pid) == "S" and starting.held_pid is None
    finally:
        watch.close()
        child.stop(grace_s=5)


def test_a_claim_file_says_how_much_of_its_share_the_part_claims(tmp_path):
    assert busy.claimed(tmp_path / "none") == 1.0  # nobody said anything: the whole share
    mine = busy.ClaimFile(tmp_path)
    assert mine.path.name.endswith(".claim") and mine.path.read_bytes() == b"1.000" and busy.claimed(tmp_path) == 1.0
    mine.set(0.25)
    assert mine.path.read_bytes() == b"0.250" and busy.claimed(tmp_path) == 0.25
    (tmp_path / "999999999.claim").write_text("1.000")  # a process that is gone never counts
    (tmp_path / f"{os.getppid()}.claim").write_text("lots!")  # nor does a file that is not a fraction
    assert busy.claimed(tmp_path) == 0.25
    (tmp_path / f"{os.getppid()}.claim").write_text("0.500")  # another live rank claims more: the most anyone claims
    assert busy.claimed(tmp_path) == 0.5
    (tmp_path / f"{os.getppid()}.claim").unlink()
    mine.set(7)  # clamped
    assert mine.path.read_bytes() == b"1.000" and busy.claimed(tmp_path) == 1.0
    taker = busy.TurnTaker(tmp_path / "t")  # the trainer's side keeps one too
    assert busy.claimed(tmp_path / "t") == 1.0
    taker.claim(0.5)
    assert busy.claimed(tmp_path / "t") == 0.5


@pytest.mark.parametrize("claim", [1.0, 0.5, 0.25])
def test_a_part_that_claims_less_of_its_share_runs_as_long_and_less_often(claim):
    """`DutyCycle.hold(..., claim)` under continuous load: held 1 - share x claim of the time, in runs of share x
    window_s (a trainer's step is longer than a shorter run would be)."""
    duty, dt, runs, held = DutyCycle(0.1, window_s=10), 0.01, [], 0
    for i in range(round(600 / dt)):
        if duty.hold(True, i * dt, claim):
            held += 1
        elif runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    assert held * dt / 600 == pytest.approx(1 - 0.1 * claim, abs=0.005)
    assert all((end - start + 1) * dt == pytest.approx(1.0, abs=0.02) for start, end in runs[:-1])


def held_share(duty: DutyCycle, busy_at, seconds: float, dt: float = 0.01) -> float:
    """The share of `seconds` (looked at every `dt`) that `duty` holds the part, serving busy when busy_at(t)."""
    ticks = round(seconds / dt)
    return sum(duty.hold(busy_at(i * dt), i * dt) for i in range(ticks)) / ticks


def back_to_back(t: float) -> bool:
    """Requests of 3 s, each followed by the 20 ms the client takes to send the next."""
    return t % 3.02 < 3.0


@pytest.mark.parametrize("share", [0.0, 0.1, 0.25, 0.5])
def test_under_continuous_load_a_paused_part_still_runs_its_share(share):
    for busy_at in (lambda t: True, back_to_back):
        assert held_share(DutyCycle(share, window_s=10), busy_at, 600) == pytest.approx((1 - share) * (3 / 3.02 if busy_at is back_to_back else 1), abs=0.01)
    assert held_share(DutyCycle(share, window_s=10), lambda t: False, 60) == 0.0
    # paced (a gap as long as each request): the gaps give it more than its share, and it is held exactly while busy
    assert held_share(DutyCycle(share, window_s=10), lambda t: t % 6 < 3, 600) == pytest.approx(0.5, abs=0.01)


def test_the_duty_cycle_holds_while_busy_until_it_has_earned_its_run():
    duty = DutyCycle(0.25, window_s=10)
    assert duty.hold(True, 0.0) and duty.hold(True, 7.4)  # held 7.4 s: 2.47 s earned of the 2.5 s it runs on
    assert not duty.hold(True, 7.6) and not duty.hold(True, 9.9)  # then runs on what it earned, busy or not
    assert duty.hold(True, 10.2) and duty.hold(True, 17.6) and not duty.hold(True, 17.8)
    assert [DutyCycle(0.0).hold(True, t) for t in (0, 100, 1000)] == [True] * 3  # share 0: plain pause


def test_time_the_part_is_stopped_for_another_reason_neither_earns_nor_spends():
    """`DutyCycle.stand`: benchmarks.drift's other sides' turns, when the trainer is stopped whatever serving does."""
    duty = DutyCycle(0.25, window_s=10)
    assert duty.hold(True, 0.0) and duty.hold(True, 5.0)  # held 5 s: 1.67 s earned
    duty.stand(100.0)  # stopped for another reason from 5 s to 100 s
    assert duty.hold(True, 102.4) and not duty.hold(True, 102.6)  # 7.4 s, then 7.6 s held in all: it runs


def test_the_watch_stops_the_part_whenever_also_says_so(tmp_path):
    child = spawn("train", [sys.executable, "-c", "import time; time.sleep(120)"], log_path=tmp_path / "train.log")
    supervisor = SimpleNamespace(children={"train": child}, restarting=lambda name: False)
    other_turn = [True]
    watch = HoldWhileBusy(Hold(supervisor, "train"), tmp_path / "busy", every_s=0.01, duty=DutyCycle(0.25),
                          also=lambda: other_turn[0])
    watch.start()
    try:
        assert wait_for(child.pid, "T") == "T"  # serving idle, but stopped all the same
        other_turn[0] = False
        assert wait_for(child.pid, "S") == "S"
    finally:
        watch.close()
        child.stop(grace_s=5)


def test_serving_waits_between_steps_while_the_trainer_has_its_turn(tmp_path, caplog):
    """`dvi.busy.Turn` (the supervisor's) and `TurnWait` (serving's, before each step)."""
    caplog.set_level(logging.INFO, logger="dvi.test.turns")
    directory = tmp_path / "busy"
    waiter = busy.TurnWait(directory, max_s=5.0, poll_s=0.001, say=logging.getLogger("dvi.test.turns"))
    assert waiter.wait() == 0.0  # no directory, no turn
    turn = busy.Turn(directory)
    turn.give(True)
    assert (directory / busy.TURN).read_text().strip() == str(os.getpid()) and not turn.taken()
    seen = []

    def end_turn():
        deadline = time.monotonic() + 5
        while not turn.taken() and time.monotonic() < deadline:  # serving says it waits ...
            time.sleep(0.005)
        seen.append(turn.taken())
        time.sleep(0.2)
        turn.give(False)  # ... and goes on once the turn is taken back

    ender = threading.Thread(target=end_turn)
    ender.start()
    waited = waiter.wait()
    ender.join()
    assert seen == [True] and 0.2 <= waited < 2.0 and not turn.taken() and not (directory / busy.TURN).exists()
    assert waiter.turns == 1 and waiter.waited_s == waited
    assert [r.getMessage().split(" between")[0] for r in caplog.records] == [f"serving waited {waited:.2f} s"]
    assert list(directory.iterdir()) == []  # its waiting file gone with the wait
    # a turn file whose supervisor is gone, or one that is not a pid, holds nothing up; a new supervisor removes it
    (directory / busy.TURN).write_text("999999999\n")
    assert waiter.wait() == 0.0
    (directory / busy.TURN).write_text("half a pi")
    assert waiter.wait() == 0.0 and waiter.turns == 1
    # a supervisor that never takes its turn back costs one wait of max_s, not one a step
    turn = busy.Turn(directory)
    assert not (directory / busy.TURN).exists()
    turn.give(True)
    short = busy.TurnWait(directory, max_s=0.1, poll_s=0.001)
    assert 0.1 <= short.wait() < 1.0 and short.wait() == 0.0
    turn.give(False)
    turn.give(True)  # a new turn is waited for again
    assert short.wait() >= 0.1


def test_the_paused_part_runs_its_share_alone_serving_stepping_aside(tmp_path):
    """`HoldWhileBusy.look` under continuous load: held while serving is busy until the duty cycle owes it its run;
    then its turn is given, and it goes on once serving waits (or after TURN_GRACE_S); stopped again before the turn
    is taken back."""
    held = []
    watch = HoldWhileBusy(SimpleNamespace(set=held.append), tmp_path / "busy", duty=DutyCycle(0.25, window_s=10))
    serving = busy.BusyFile(tmp_path / "busy")
    serving.set(True)
    turn_file = tmp_path / "busy" / busy.TURN

    watch.look(0.0)
    watch.look(7.4)
    assert held == [True, True] and not turn_file.exists()
    watch.look(7.6)  # its turn: given, but the part waits for serving to step aside
    assert held[-1] is True and turn_file.exists()
    waiting = tmp_path / "busy" / f"{os.getpid()}{busy.WAITING}"
    waiting.touch()  # serving waits between two steps
    watch.look(7.62)
    assert held[-1] is False and turn_file.exists()
    waiting.unlink()
    watch.look(9.0)  # serving no longer says it waits (it may be stopped mid-look): the turn runs on
    assert held[-1] is False
    watch.look(10.2)  # spent: stopped, then the turn taken back
    assert held[-1] is True and not turn_file.exists()
    # a step that does not end within the grace (a long prefill): the part goes on anyway
    watch.look(17.8)
    assert held[-1] is True and turn_file.exists()
    watch.look(17.8 + HoldWhileBusy.TURN_GRACE_S)
    assert held[-1] is False
    watch.close()
    assert held[-1] is False and not turn_file.exists()
    # serving idle through its turn: it runs at once
    held.clear()
    idle = HoldWhileBusy(SimpleNamespace(set=held.append), tmp_path / "idle", duty=DutyCycle(0.25, window_s=10))
    serving_idle = busy.BusyFile(tmp_path / "idle")
    serving_idle.set(True)
    idle.look(0.0)
    idle.look(7.6)
    serving_idle.set(False)
    idle.look(7.62)
    assert held[-1] is False


def test_a_turn_the_part_has_no_use_for_ends_early_and_the_next_is_earned_afresh(tmp_path):
    """A part that says it has nothing to do (`dvi.busy.IdleFile`: a trainer whose trigger is not active, or with no
    batch to step on) `IDLE_AFTER_S` into its turn is stopped and the turn taken back: serving waited that long, not
    the share; the duty cycle's next turn comes after a whole window's holding."""
    held = []
    watch = HoldWhileBusy(SimpleNamespace(set=held.append), tmp_path, duty=DutyCycle(0.25, window_s=10))
    busy.BusyFile(tmp_path).set(True)
    part = busy.IdleFile(tmp_path)
    turn_file = tmp_path / busy.TURN
    (tmp_path / f"{os.getpid()}{busy.WAITING}").touch()  # serving waits between two steps whenever there is a turn
    watch.look(0.0)
    watch.look(7.6)  # its turn
    watch.look(7.62)
    assert held[-1] is False and turn_file.exists()
    part.set(True)  # stopped while waiting for records: it may find some once it goes on
    watch.look(7.6 + HoldWhileBusy.IDLE_AFTER_S - 0.01)
    assert held[-1] is False and turn_file.exists()
    part.set(False)  # it had work after all: the turn runs on
    watch.look(7.6 + HoldWhileBusy.IDLE_AFTER_S + 0.1)
    assert held[-1] is False and turn_file.exists()
    part.set(True)
    watch.look(8.0)  # nothing to do: stopped, then the turn taken back, 2.5 s of share unspent
    assert held[-1] is True and not turn_file.exists()
    watch.look(15.4)  # 7.4 s held earns 2.47 s: not yet
    assert held[-1] is True and not turn_file.exists()
    watch.look(15.6)
    assert turn_file.exists()
    watch.close()


def test_the_part_s_turns_come_as_often_as_it_claims(tmp_path):
    """`HoldWhileBusy` reads the part's claim (`dvi.busy.ClaimFile`) while it earns its next turn: half of a share of
    0.25 earns a turn of 2.5 s after 17.5 s held, not 7.5."""
    held = []
    watch = HoldWhileBusy(SimpleNamespace(set=held.append), tmp_path, duty=DutyCycle(0.25, window_s=10))
    busy.BusyFile(tmp_path).set(True)
    busy.ClaimFile(tmp_path).set(0.5)
    turn_file = tmp_path / busy.TURN
    watch.look(0.0)
    watch.look(7.6)
    watch.look(17.4)
    assert held == [True] * 3 and not turn_file.exists()
    watch.look(17.6)
    assert turn_file.exists()
    watch.close()


def test_a_paused_trainer_keeps_its_consumer_group_over_a_requests_stop():
    from dvi.cli.up import PAUSED_SESSION_MS, plan
    from dvi.config import load_config

    def train_args(*overrides):
        return next(p.args for p in plan(load_config(list(overrides))) if p.name == "train")

    assert train_args("trainer.cpu_priority=pause") == ["train", f"stream.session_timeout_ms={PAUSED_SESSION_MS}"]
    assert train_args("trainer.cpu_priority=pause", "stream.session_timeout_ms=60000") == ["train", "stream.session_timeout_ms=60000"]
    assert train_args("trainer.cpu_priority=normal") == ["train"]
    # auto: paused on the CPU cores the server runs on, not on cores of its own
    paused = ["train", f"stream.session_timeout_ms={PAUSED_SESSION_MS}"]
    assert train_args("model.device=cpu") == paused
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    apart = train_args("model.device=cpu", "serve.engine=vllm-server", f"trainer.cpu_bind={last}", f"serve.vllm.cpu_bind={first}")
    assert apart == (["train"] if first != last else paused)
    # where no trainer runs, its settings are not read: a core it may not use is the trainer's error alone
    assert [p.name for p in plan(load_config(["trainer.cpu_bind=999"]), only={"broker", "mlflow"})] == ["broker", "mlflow"]
    assert [p.name for p in plan(load_config(["trainer.cpu_bind=999"]), train=False)] == ["broker", "mlflow", "serve"]
    with pytest.raises(DviError, match=r"trainer.cpu_bind='999' names cores 999"):
        plan(load_config(["trainer.cpu_bind=999", "model.device=cpu"]))
