"""The environment for a `dvi` child process a test starts (train, serve): this process's, without the DeepSpeed
world that the in-process `ds_world` fixture leaves in it (RANK, WORLD_SIZE, ...). A child that inherited those
would take them for a launcher's and join this process's rendezvous port; it starts a world of its own. And
`run_to_end`: a benchmark run as a child, stopped as Ctrl-C stops it if it runs out of time."""

from __future__ import annotations

import os
import signal
import subprocess

DISTRIBUTED = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the distributed variables, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if k not in DISTRIBUTED}, **extra}


def run_to_end(cmd: list[str], timeout_s: float, grace_s: float = 120.0, **kw) -> subprocess.CompletedProcess:
    """`cmd` run to its end, its output captured (text). Past `timeout_s` (or when anything else interrupts the wait,
    such as the test's own time limit) it gets SIGINT, as Ctrl-C, so that it stops the processes it started (a
    benchmark's servers and trainer, which a SIGKILL of it alone would leave running), and SIGKILL only if it has not
    ended `grace_s` later; past `timeout_s`, AssertionError with the end of its output."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as child:
        try:
            out, err = child.communicate(timeout=timeout_s)
        except BaseException as e:
            child.send_signal(signal.SIGINT)
            try:
                out, err = child.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                child.kill()
                out, err = child.communicate()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            raise AssertionError(f"{' '.join(cmd[:4])} ... ran past {timeout_s:.0f} s and was stopped:\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)
