"""The trainer loop's timing decisions, as pure logic on an explicit clock: when it gives freed heap memory back to the
system (`trainers.triggers.release_due`; the release itself, glibc's `malloc_trim`, is tested against glibc in
tests/dvi/test_alloc.py), how far apart slow gate checks are spaced (`next_gate_in`) and when a short batch steps
(`batch_ready`)."""

from __future__ import annotations

from dvi.alloc import RELEASE_EVERY_S
from trainers.triggers import STREAM_PAUSE_S, batch_ready, next_gate_in, release_due


def test_freed_memory_goes_back_after_a_step_at_most_once_a_minute_also_when_the_loop_then_idles():
    t0 = 1000.0
    assert not release_due(5, 5, t0 + 10 * RELEASE_EVERY_S, t0)  # no step since the last release: nothing new freed
    assert not release_due(6, 5, t0 + RELEASE_EVERY_S / 2, t0)  # too soon
    assert release_due(6, 5, t0 + RELEASE_EVERY_S, t0)  # a step since, a minute on: also on an idle turn of the loop


def test_a_slow_gate_check_spaces_the_next_so_checks_take_at_most_their_share_of_the_time():
    assert next_gate_in(60.0, 2.0, 0.25) == 60.0  # a quick check: every gate_every_s
    assert next_gate_in(60.0, 180.0, 0.25) == 720.0  # a 3-minute check: the next starts 12 minutes after it began
    took, share = 180.0, 0.25
    assert took / next_gate_in(60.0, took, share) <= share
    assert next_gate_in(60.0, 180.0, 1.0) == 180.0  # share 1: back to back, as before the share existed


def test_a_short_batch_steps_once_the_stream_pauses_or_at_once_in_the_trainers_turn():
    def turn(answer: bool):
        asked = []
        return asked, lambda: asked.append(1) or answer

    asked, no_turn = turn(False)
    assert batch_ready(384, 384.0, 0.0, no_turn) and not asked  # a full batch: the turn file is not even read
    assert not batch_ready(100, 384.0, 0.2, no_turn)  # short, the stream flowing: it waits for more
    assert batch_ready(100, 384.0, STREAM_PAUSE_S + 0.1, no_turn)  # short, the stream paused: it steps
    assert batch_ready(100, 384.0, 0.2, turn(True)[1])  # short, but serving waits for its turn: no record comes, it steps
    asked, in_turn = turn(True)
    assert not batch_ready(0, 384.0, 5.0, in_turn) and not asked  # nothing waiting: nothing to step, turn or not
