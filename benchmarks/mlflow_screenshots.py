"""Screenshots of a running MLflow as a person sees it: the experiment `dvi`, its runs, the registered drafter.

Starts nothing: point it at the MLflow of a running stack (`dvi up`, or `python -m benchmarks.first_publish`) and
it renders each page with headless Chromium (`apt-get install -y chromium`) into PNGs, printing each path:

    python -m benchmarks.mlflow_screenshots --uri http://127.0.0.1:5000 --out outputs/mlflow

Pages: the experiment list, experiment `dvi` as dvi links it (the saved view `dvi`: runs with their key figures as
columns, charts on shared axes), as the plain classic page, and as MLflow 3.17 opens it without any parameter (the
GenAI overview), the `trainer` run and each `serve-*` run
(overview and model-metrics charts), the serve run's `plots/drift.png` artifact (the file itself), and the registered model
`dvi-drafter` (versions, aliases, tags). Page addresses come from MLflow's REST API (urllib only).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from dvi.tracking import CLASSIC_VIEW, experiment_link, rest

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def pages(uri: str, experiment: str, model: str) -> list[tuple[str, str]]:
    """(name, URL) of the pages to capture."""
    base = uri.rstrip("/")
    out = [("experiments", f"{base}/#/experiments{CLASSIC_VIEW}")]
    exp = rest(uri, "experiments/get-by-name", {"experiment_name": experiment})["experiment"]
    eid = exp["experiment_id"]
    out.append(("experiment-view", experiment_link(base, eid)))  # the link dvi prints: the saved view `dvi`
    out.append(("experiment-view-charts", experiment_link(base, eid) + "&compareRunsMode=CHART"))  # its chart view
    out.append(("experiment-as-linked", f"{base}/#/experiments/{eid}{CLASSIC_VIEW}"))
    out.append(("experiment-default-view", f"{base}/#/experiments/{eid}"))  # what MLflow shows without the parameter
    runs = rest(uri, "runs/search", body={"experiment_ids": [eid], "max_results": 20,
                                          "order_by": ["attributes.start_time DESC"]}).get("runs") or []
    seen = set()
    for run in runs:
        name = run["info"].get("run_name") or run["info"]["run_id"]
        if name in seen:
            continue
        seen.add(name)
        rid = run["info"]["run_id"]
        out.append((f"run-{name}", f"{base}/#/experiments/{eid}/runs/{rid}{CLASSIC_VIEW}"))
        out.append((f"run-{name}-charts", f"{base}/#/experiments/{eid}/runs/{rid}/model-metrics{CLASSIC_VIEW}"))
        if name.startswith("serve-"):
            path = urllib.parse.quote("plots/drift.png")
            out.append((f"run-{name}-drift-png", f"{base}/get-artifact?path={path}&run_uuid={rid}"))
    out.append(("model", f"{base}/#/models/{urllib.parse.quote(model)}{CLASSIC_VIEW}"))
    return out


def save(url: str, png: Path) -> bool:
    """The file at `url` into `png`; False when MLflow does not serve it."""
    try:
        with urllib.request.urlopen(url, timeout=60) as resp:
            png.write_bytes(resp.read())
    except OSError:
        return False
    return True


def shoot(chromium: str, url: str, png: Path, width: int, height: int, wait_ms: int) -> bool:
    """One page into `png` with a fresh profile; False when Chromium did not finish in time (it is then killed)."""
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="dvi-chromium-") as profile:
        try:
            subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                            f"--virtual-time-budget={wait_ms}", f"--screenshot={png}", url],
                           capture_output=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            return False
    return png.exists()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uri", default="http://127.0.0.1:5000")
    p.add_argument("--experiment", default="dvi")
    p.add_argument("--model", default="dvi-drafter")
    p.add_argument("--out", default="outputs/mlflow")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--wait-ms", type=int, default=60000, help="virtual time for the page's scripts to render")
    p.add_argument("--only", action="append", metavar="PAGE", help="just this page (by name; repeatable)")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        print("dvi: error: no chromium on PATH (apt-get install -y chromium)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, url in pages(args.uri, args.experiment, args.model):
        if args.only and name not in args.only:
            continue
        png = out / f"{name}.png"
        if name.endswith("-drift-png"):  # an artifact, not a page: MLflow serves it as a download, so it is saved as it is
            ok = save(url, png)
        else:
            ok = shoot(chromium, url, png, args.width, args.height, args.wait_ms)
        print(f"{png}  {url}" if ok else f"FAILED {name}  {url}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
