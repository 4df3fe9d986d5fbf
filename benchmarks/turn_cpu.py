"""Who uses the CPU while `dvi up`'s trainer has its turn, and while it does not: each process's CPU time (user +
system, from /proc) over `--seconds`, looked at every `--every-s`, split by whether the turn file (`dvi.busy.Turn`)
was in the stack's busy directory. Under the pause policy the trainer's turn is meant to have the cores to itself
(serving waits between two steps); a process that still burns a core then is what the trainer loses.

Run beside a stack under load, e.g. `benchmarks.first_publish` (whose stack's cache is the newest
/tmp/dvi-first-publish-*, the default here), once its requests have started:

    python -m benchmarks.turn_cpu [--busy DIR] [--seconds 150] [--every-s 0.05] [--json PATH]

It measures; it asserts nothing. Its own sampling shows in its table too (a few percent of a core).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import time
from pathlib import Path

from dvi.busy import TURN

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> dict[int, int]:
    """Every process's user + system CPU time so far, in clock ticks."""
    out = {}
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = open(path).read()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2:].split()  # past the command name, which may hold spaces
        out[int(path.split("/")[2])] = int(fields[11]) + int(fields[12])
    return out


def command(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()[:100] or f"pid {pid}"
    except OSError:
        return f"pid {pid}"


def newest_busy_dir() -> Path:
    caches = sorted(glob.glob("/tmp/dvi-first-publish-*"), key=os.path.getmtime)
    if not caches:
        raise SystemExit("no /tmp/dvi-first-publish-* stack: give --busy <cache>/busy")
    return Path(caches[-1]) / "busy"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--busy", type=Path, default=None, help="the stack's busy directory (<cache>/busy)")
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--every-s", type=float, default=0.05)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    turn_file = (args.busy or newest_busy_dir()) / TURN
    used = {True: collections.Counter(), False: collections.Counter()}
    wall = {True: 0.0, False: 0.0}
    names: dict[int, str] = {}
    before, then, turn = cpu_ticks(), time.monotonic(), turn_file.exists()
    end = then + args.seconds
    while then < end:
        time.sleep(args.every_s)
        now_ticks, now = cpu_ticks(), time.monotonic()
        for pid, ticks in now_ticks.items():
            if ticks > before.get(pid, ticks):
                used[turn][pid] += ticks - before[pid]
                names.setdefault(pid, command(pid))
        wall[turn] += now - then
        before, then, turn = now_ticks, now, turn_file.exists()
    result = {"busy": str(turn_file.parent), "seconds": args.seconds}
    for side, label in ((True, "trainer's turn"), (False, "no turn")):
        rows = [{"pid": pid, "command": names[pid], "cores": round(ticks / TICKS / max(wall[side], 1e-9), 3)}
                for pid, ticks in used[side].most_common(10)]
        result[label] = {"wall_s": round(wall[side], 1), "processes": rows}
        print(f"{label}: {wall[side]:.1f} s")
        for row in rows:
            print(f"  {row['cores']:6.2f} cores  pid {row['pid']:<7d} {row['command']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
