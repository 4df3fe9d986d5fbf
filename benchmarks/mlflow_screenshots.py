"""Screenshots of a running MLflow as a person sees it: the experiment `dvi`, its runs, the registered drafter.

Starts nothing: point it at the MLflow of a running stack (`dvi up`, or `python -m benchmarks.first_publish`) and
it renders each page with headless Chromium (`apt-get install -y chromium`) into PNGs, printing each path:

    python -m benchmarks.mlflow_screenshots --out outputs/mlflow

It logs in as dvi's parts do: the local server's login (`dvi.mlflow_login.local_login`), or for `--uri` the MLflow client's
variables. Chromium gets the login over its DevTools pipe, as a header on every request, never on its command line.

Pages: the experiment list, experiment `dvi` as dvi links it (the saved view `dvi`: runs with their key figures as
columns, charts on shared axes), as the plain classic page, and as MLflow 3.17 opens it without any parameter (the
GenAI overview), the `trainer` run and each `serve-*` run
(overview and model-metrics charts), the serve run's `plots/drift.png` artifact (the file itself), and the registered model
`dvi-drafter` (versions, aliases, tags). Page addresses come from MLflow's REST API (urllib only).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from dvi.config import load_config
from dvi.mlflow_login import auth_headers, local_login
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
    """The file at `url` into `png`, logged in; False when MLflow does not serve it."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=60) as resp:
            png.write_bytes(resp.read())
    except OSError:
        return False
    return True


class DevTools:
    """Chromium driven over its DevTools pipe (fds 3 and 4 of the child, `--remote-debugging-pipe`): no port is
    opened, and the login travels in a message, never on Chromium's command line."""

    def __init__(self, chromium: str, profile: str, width: int, height: int):
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()

        def fds() -> None:  # in the child: commands on fd 3, answers on fd 4 (moved out of the way first)
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_child, from_child)]
            for fd, at in zip(high, (3, 4)):
                os.dup2(fd, at)

        self.proc = subprocess.Popen([chromium, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     preexec_fn=fds, pass_fds=(3, 4),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self._buf, self._id, self.session = b"", 0, None

    def send(self, method: str, params: dict | None = None, timeout_s: float = 60.0) -> dict:
        """One command (to the page's session once attached); its result, or RuntimeError with its error."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        answer = self.wait(lambda m: m.get("id") == self._id, timeout_s)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def wait(self, match, timeout_s: float) -> dict:
        """The first message (answer or event) `match` accepts; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if match(msg):
                    return msg
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium exited")
            self._buf += chunk

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=5)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._in)
        os.close(self._out)


def shoot(chromium: str, url: str, png: Path, width: int, height: int, wait_ms: int) -> bool:
    """One page into `png` with a fresh profile, sending the MLflow login with every request; False when Chromium
    did not render it in time."""
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="dvi-chromium-") as profile:
        browser = DevTools(chromium, profile, width, height)
        try:
            target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            browser.session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            browser.send("Network.enable")
            browser.send("Network.setExtraHTTPHeaders", {"headers": auth_headers()})
            browser.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                                "mobile": False})
            browser.send("Page.enable")
            browser.send("Page.navigate", {"url": url})
            browser.wait(lambda m: m.get("method") == "Page.loadEventFired", 120)
            time.sleep(wait_ms / 1000)  # the page's own fetches and charts, after its load event
            data = browser.send("Page.captureScreenshot", {"format": "png"})["data"]
            png.write_bytes(base64.b64decode(data))
        except (OSError, RuntimeError, TimeoutError, KeyError):
            return False
        finally:
            browser.close()
    return png.exists()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uri", help="an MLflow (login: the MLflow client's variables); default: dvi's local one, with its login")
    p.add_argument("--experiment", default="dvi")
    p.add_argument("--model", default="dvi-drafter")
    p.add_argument("--out", default="outputs/mlflow")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--wait-ms", type=int, default=8000, help="time for the page's scripts to render, after it loads")
    p.add_argument("--only", action="append", metavar="PAGE", help="just this page (by name; repeatable)")
    p.add_argument("overrides", nargs="*", help="dvi config overrides naming the local MLflow (tracking.port=..., tracking.root=...)")
    args = p.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        print("dvi: error: no chromium on PATH (apt-get install -y chromium)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    uri = args.uri
    if uri is None:
        local = load_config(args.overrides).tracking
        local_login(local)
        uri = local.tracking_uri
    for name, url in pages(uri, args.experiment, args.model):
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
