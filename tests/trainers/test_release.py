"""When the trainer's loop gives freed heap memory back to the system (`trainers.recipe.release_due`; the release
itself, glibc's `malloc_trim`, is tested against glibc in tests/dvi/test_alloc.py). Pure logic, explicit clock."""

from __future__ import annotations

from trainers.recipe import RELEASE_EVERY_S, release_due


def test_freed_memory_goes_back_after_a_step_at_most_once_a_minute_also_when_the_loop_then_idles():
    t0 = 1000.0
    assert not release_due(5, 5, t0 + 10 * RELEASE_EVERY_S, t0)  # no step since the last release: nothing new freed
    assert not release_due(6, 5, t0 + RELEASE_EVERY_S / 2, t0)  # too soon
    assert release_due(6, 5, t0 + RELEASE_EVERY_S, t0)  # a step since, a minute on: also on an idle turn of the loop
