"""A command line checked before any heavy library loads: a mistake is answered in a second, not after the seconds that
importing torch, transformers and Kafka's client take (`Command.check` in the command table, then the command itself
reads its settings from here). It knows the config and the options; it loads no model and opens no connection."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dvi.config import DviConfig, check_sampling, load_config, overrides_of
from dvi.errors import DviError


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
    return Generate(cfg, temperature, top_p, max_new, seed)


def config(args: argparse.Namespace) -> DviConfig:
    """The config of a command that takes overrides, checked."""
    return load_config(overrides_of(args))
