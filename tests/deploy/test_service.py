"""deploy/dvi.service: the systemd unit runs `dvi up` (a command line the real parser accepts), restarts it on
failure, stops it with SIGTERM (dvi up's ordered shutdown) and gives that shutdown time; `systemd-analyze verify`
accepts it without a warning where systemd is installed."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dvi.cli import build_parser

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "dvi.service"


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_the_unit_runs_dvi_up_restarts_on_failure_and_stops_it_in_order():
    u = unit()
    service = u["Service"]
    exec_start = service["ExecStart"].split()
    assert exec_start[1:4] == ["-m", "dvi.cli", "up"], exec_start
    args, unknown = build_parser().parse_known_args(exec_start[3:])
    assert args.run == "up:up" and not args.detach and not unknown  # foreground: systemd supervises the process
    assert service["Restart"] == "on-failure" and float(service["RestartSec"]) > 0
    assert service["KillSignal"] == "SIGTERM" and service["KillMode"] == "mixed"
    assert float(service["TimeoutStopSec"]) >= 120  # dvi up gives each part up to 30 s to stop
    assert u["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_verify_accepts_the_unit(tmp_path):
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here (the unit's content is checked by the test above)")
    text = UNIT.read_text().replace("/opt/dvi/.venv/bin/python", sys.executable)  # verify wants an executable that exists
    text = text.replace("User=dvi", "User=root").replace("Group=dvi", "Group=root")
    path = tmp_path / "dvi.service"
    path.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if str(path) in line or "dvi.service" in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr
