"""dvi.waiting: a quick step says nothing; a slow one says what it waits for, while it waits, and how it ended."""

from __future__ import annotations

import logging
import time

import pytest

from dvi.waiting import waiting_for


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dvi.wait"]


def test_a_quick_step_says_nothing(caplog):
    caplog.set_level(logging.INFO, logger="dvi.wait")
    with waiting_for("the broker", after_s=0.5):
        pass
    assert lines(caplog) == []


def test_a_slow_step_says_what_it_waits_for_while_it_waits_and_when_it_is_ready(caplog):
    caplog.set_level(logging.INFO, logger="dvi.wait")
    with waiting_for("the broker at 127.0.0.1:1", after_s=0.1, every_s=0.15):
        time.sleep(0.5)
        assert lines(caplog)[0].startswith("waiting for the broker at 127.0.0.1:1 (")  # said during the wait
    said = lines(caplog)
    assert 2 <= len(said) - 1 <= 4 and all(s.startswith("waiting for the broker") for s in said[:-1])
    assert said[-1].startswith("the broker at 127.0.0.1:1: ready after")


def test_a_step_that_fails_says_it_gave_up_and_the_error_goes_through(caplog):
    caplog.set_level(logging.INFO, logger="dvi.wait")
    with pytest.raises(RuntimeError, match="no broker"):
        with waiting_for("the broker", after_s=0.05):
            time.sleep(0.2)
            raise RuntimeError("no broker")
    assert lines(caplog)[-1].startswith("the broker: gave up after")
