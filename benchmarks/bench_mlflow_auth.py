"""What MLflow's login costs a dvi client: the median time of one REST call to the local server without a login,
with the basic-auth app as dvi runs it (checked logins cached, `dvi.mlflow_server.AUTH_CACHE_S`), and with that
cache off (every request pays the password hash). Side by side in one run, as ratios to the server without a login.

    python -m benchmarks.bench_mlflow_auth [--calls 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dvi.mlflow_login import PASSWORD_VAR, USER_VAR
from dvi.mlflow_server import AUTH_CACHE_S, LocalMlflow
from dvi.procs import free_port
from dvi.tracking import rest


def median_call_s(uri: str, calls: int) -> float:
    rest(uri, "experiments/get-by-name", {"experiment_name": "Default"}, timeout_s=30)  # warm: the first check is paid once
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        rest(uri, "experiments/get-by-name", {"experiment_name": "Default"}, timeout_s=30)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    os.environ.pop(USER_VAR, None)
    os.environ.pop(PASSWORD_VAR, None)
    out = {}
    for name, auth, cache_s in (("no login", False, 0), ("login, cached", True, AUTH_CACHE_S), ("login, uncached", True, 0)):
        with tempfile.TemporaryDirectory() as root:
            with LocalMlflow(Path(root), free_port(), auth=auth, auth_cache_s=cache_s) as server:
                out[name] = median_call_s(server.uri, args.calls)
    base = out["no login"]
    for name, s in out.items():
        print(f"{name:16s} {s * 1000:7.1f} ms per call  ({s / base:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"median_call_s": out, "calls": args.calls}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
