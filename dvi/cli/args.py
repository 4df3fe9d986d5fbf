"""A command line checked before any heavy library loads: a mistake is answered in a second, not after the seconds that
importing torch, transformers and Kafka's client take (`Command.check` in the command table, then the command itself
reads its settings from here). It knows the config and the options; it loads no model and opens no connection. The
model paths a command line names are checked here too (`dvi.model_files`), and, for the commands that load the pair
in this process, the device and dtype (`dvi.hardware.resolve_device`: torch, not transformers). `dvi serve` given
cores of its own is narrowed to them here, before torch loads (`serve`), and so is the trainer (`train`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from dvi.alloc import limit_kernel_caches
from dvi.config import INIT_DRAFTER, DviConfig, check_sampling, load_config, overrides_of
from dvi.errors import DviError
from dvi.hardware import (Pick, bound_cores, lower_cpu_priority, pick_cpu_priority, pick_engine, replica_cores, resolve_device,
                          resolve_dtype)
from dvi.model_files import require_gguf_file, require_model_dir


@dataclass(frozen=True)
class Generate:
    """What `dvi generate` was asked: the config and the request's sampling."""

    cfg: DviConfig
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int | None


def generate(args: argparse.Namespace) -> Generate:
    """`dvi generate`'s config (overrides applied) and sampling (options over `serve.sampling`), checked; a non-empty prompt."""
    cfg = load_config(overrides_of(args))
    s = cfg.serve.sampling
    temperature = 0.0 if args.greedy else (args.temperature if args.temperature is not None else s.temperature)
    top_p = args.top_p if args.top_p is not None else s.top_p
    max_new = args.max_new_tokens if args.max_new_tokens is not None else s.max_new_tokens
    seed = args.seed if args.seed is not None else s.seed
    check_sampling(temperature, top_p, max_new)
    if not args.prompt.strip():
        raise DviError("empty prompt: give some text to continue")
    resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))  # as `dvi.pairs.resolve_pair` checks them, first
    model_paths(cfg, with_drafter=not args.no_draft)
    return Generate(cfg, temperature, top_p, max_new, seed)


def model_paths(cfg: DviConfig, with_drafter: bool = True) -> None:
    """The target and drafter directories the config names, where it names them (null: the demo pair, fetched and
    built later; a .gguf target: imported later, `fetch`), are model directories (`dvi.pairs.check_pair_dirs` reads
    their tokenizers once the libraries load)."""
    if cfg.model.target and not str(cfg.model.target).endswith(".gguf"):
        require_model_dir(cfg.model.target, "target")
    if with_drafter and cfg.model.drafter and cfg.model.drafter != INIT_DRAFTER:
        require_model_dir(cfg.model.drafter, "drafter")


def config(args: argparse.Namespace) -> DviConfig:
    """The config of a command that takes overrides, checked."""
    return load_config(overrides_of(args))


def fetch(args: argparse.Namespace) -> DviConfig:
    """`dvi models fetch`'s config, checked, and its file (`--gguf`: a GGUF file) or, with `--pair`, the device and
    dtype it checks (`dvi.hardware.resolve_dtype`)."""
    cfg = config(args)
    if args.gguf:
        require_gguf_file(args.gguf)
    elif args.pair:
        resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
    return cfg


def serve(args: argparse.Namespace) -> DviConfig:
    """`dvi serve`'s config, checked with the cores it names (`dvi.hardware.bound_cores`). A replica on vLLM's own
    server given cores of its own (`replica_cores`) runs on them alone from here on, this process and every one it
    starts: torch is not loaded yet, and its import visits every core the process may use. The cores the process
    could use before are kept in `args.usable_cores`."""
    cfg = config(args)
    model_paths(cfg, with_drafter=not getattr(args, "no_draft", False))
    args.usable_cores = bound_cores("auto")  # before narrowing: what `dvi serve` may advise a replica to take
    if pick_engine(cfg.serve.engine).value != "vllm-server":
        return cfg
    bind = cfg.serve.vllm.cpu_bind
    if (own := replica_cores(bind, bound_cores(bind))) is not None:  # bound_cores: DviError for a core not ours
        os.sched_setaffinity(0, own)
    return cfg


def train(args: argparse.Namespace) -> DviConfig:
    """`dvi train`'s and `dvi drafter distill`'s config, checked. Torch is not loaded yet: the caches of its bf16 CPU
    matmuls are capped (`dvi.alloc.limit_kernel_caches`), and given cores of its own (`trainer.cpu_bind`), the process
    runs on them alone from here on, with one torch thread per core (torch sizes its thread pool from the cores the
    process may use)."""
    cfg = config(args)
    limit_kernel_caches()  # the bf16 target forward meets a new shape with each batch (dvi.alloc)
    if cfg.trainer.cpu_bind != "auto":
        cores = bound_cores(cfg.trainer.cpu_bind, "trainer.cpu_bind")  # DviError for a core not ours
        os.sched_setaffinity(0, cores)
        os.environ.setdefault("OMP_NUM_THREADS", str(len(cores)))  # where the user set none
    return cfg


def online_train(args: argparse.Namespace) -> DviConfig:
    """`dvi train`'s config (`train`), and the process at the CPU priority `trainer.cpu_priority` names
    (`dvi.hardware.lower_cpu_priority`: the online trainer beside serving on one machine), set before torch starts its
    threads so that every one of them has it."""
    cfg = train(args)
    lower_cpu_priority(cfg.trainer.cpu_priority)  # auto: normal or pause (trainer_priority), neither changes it
    return cfg


def trainer_priority(cfg: DviConfig) -> Pick:
    """The CPU priority `trainer.cpu_priority` settles to for the online trainer beside `cfg`'s server on this machine
    (`dvi.hardware.pick_cpu_priority`; the server's cores are serve.vllm.cpu_bind's where it serves with vLLM, every
    core with dvi's own engine), and why."""
    serve_bind = cfg.serve.vllm.cpu_bind if pick_engine(cfg.serve.engine).value == "vllm-server" else "auto"
    return pick_cpu_priority(cfg.trainer.cpu_priority, cfg.model.device, cfg.trainer.cpu_bind, serve_bind)
