"""The built wheel holds every package and conf/ (as dvi/conf), and a copy of it outside any checkout loads the
configuration from there: a non-editable install runs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_the_wheel_ships_conf_and_loads_it_without_a_checkout(tmp_path: Path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                            "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("dvi-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    conf = {str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")}
    assert {f"dvi/{c}" for c in conf} <= names, sorted({f"dvi/{c}" for c in conf} - names)
    sources = {str(p.relative_to(ROOT)) for pkg in ("dvi", "streams", "trainers") for p in (ROOT / pkg).rglob("*.py")}
    assert sources <= names, sorted(sources - names)  # a new subpackage missing from pyproject's list shows here
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import dvi.config as c; cfg = c.load_config(['serve.port=9321']); "
             "print(c.CONF_DIR, cfg.serve.port, cfg.trigger.kind)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    where, port, kind = run.stdout.split()
    assert Path(where) == site / "dvi" / "conf" and port == "9321" and kind == "continuous"
