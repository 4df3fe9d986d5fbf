"""Lines that say what a process is waiting for, when a step at start-up takes more than a few seconds.

`with waiting_for("the Kafka broker at 127.0.0.1:9092"):` says nothing when the block is quick; when it is not, it
logs `waiting for <what> (N s so far)` on logger `dvi.wait` after `after_s` seconds and then every `every_s`, and
once the block ends, `<what>: ready after N s` (or `... gave up after N s` when it raised). `dvi.wait` is shown at
the default level (`dvi.cli.setup_logging`), so a person watching `dvi serve` or `dvi train` started alone, or
`dvi up`'s relay, always knows what is being waited on. A thread does the watching; the block runs undisturbed.

This module knows timing and logging; what is waited on is its callers' business.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("dvi.wait")


@contextlib.contextmanager
def waiting_for(what: str, after_s: float = 3.0, every_s: float = 10.0) -> Iterator[None]:
    started = time.monotonic()
    done = threading.Event()
    said = threading.Event()

    def watch() -> None:
        pause = after_s
        while not done.wait(pause):
            log.info("waiting for %s (%.0f s so far)", what, time.monotonic() - started)
            said.set()
            pause = every_s

    watcher = threading.Thread(target=watch, name="dvi-wait", daemon=True)
    watcher.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        watcher.join()
        if said.is_set():
            log.info("%s: %s after %.0f s", what, "ready" if ok else "gave up", time.monotonic() - started)
