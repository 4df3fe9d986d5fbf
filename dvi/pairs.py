"""A target and its drafter, loaded: `resolve_pair` for a `dvi.config.ModelConfig`, `load_any_drafter` for a drafter
directory of either kind. Each kind of drafter loads as its `dvi.drafter_kinds.DrafterKind` says (layer drafters
`dvi.models`', EAGLE-3 drafters `dvi.eagle3`'s); this module only picks the kind (`dvi.drafter_kinds.kind_of_dir`) and
knows nothing of decoding or training.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from dvi import drafters
from dvi.config import INIT_DRAFTER
from dvi.drafter_kinds import kind_of, kind_of_dir
from dvi.hardware import resolve_device, resolve_dtype
from dvi.models import (DRAFTER_META, Drafter, Pair, cache_dir, check_same_tokenizer, load_causal_lm, load_tokenizer, target_dir_of,
                        target_skeleton)

log = logging.getLogger(__name__)


def pair_dirs(cfg, with_drafter: bool = True) -> tuple[Path, Path | None]:
    """The target and drafter directories a `dvi.config.ModelConfig` names; null paths mean the demo pair, whose
    target is fetched and whose EAGLE-3 drafter is the one dvi ships (`dvi.drafters`, installed on first use). Another
    demo drafter, or `model.drafter=init`, is built from the target on first use, untrained (of kind
    `model.drafter_kind`: a layer drafter, `dvi.models.build_drafter`, or an EAGLE-3 one, `dvi.eagle3.build_eagle3`;
    `DrafterKind.build`). Loads no model."""
    target_dir = target_dir_of(cfg)
    if not with_drafter:
        return target_dir, None
    if cfg.drafter and cfg.drafter != INIT_DRAFTER:
        return target_dir, Path(cfg.drafter).expanduser()
    if drafters.applies(cfg):
        return target_dir, drafters.installed_bootstrap(cache_dir(cfg), target_dir)
    kind = kind_of(cfg.drafter_kind)
    drafter_dir = kind.demo_dir(cache_dir(cfg), cfg.drafter_layers, cfg.drafter_vocab)
    if not (drafter_dir / DRAFTER_META).exists():
        log.info("building the demo %s drafter at %s", kind.name, drafter_dir)
        kind.build(target_dir, drafter_dir, cfg.drafter_layers, cfg.drafter_vocab)
    return target_dir, drafter_dir


def check_pair_dirs(target_dir: Path, drafter_dir: Path | None) -> PreTrainedTokenizerBase:
    """What dvi checks of a pair before any weights load, for its own engine (`resolve_pair`) and before an engine that
    loads the pair itself (vLLM's server) starts: both are Hugging Face model directories and the drafter shares the
    target's tokenizer. Reads tokenizers only; raises DviError naming the path. Returns the target's tokenizer."""
    tokenizer = load_tokenizer(target_dir, "target")
    if drafter_dir is not None:
        check_same_tokenizer(tokenizer, load_tokenizer(drafter_dir, "drafter"))
    return tokenizer


def load_any_drafter(path: str | Path, target_vocab_size: int, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu", target=None, embed: torch.Tensor | None = None) -> Drafter:
    """A drafter directory as a `Drafter`: a layer drafter (`dvi.models.load_drafter`), or with `target` (the loaded
    target) an EAGLE-3 one too (`dvi.eagle3.load_for_target`: its `.model` an `Eagle3Drafter` over the target's
    features, its `.vocab_map` the draft vocabulary's target ids); or, with `embed` (the target's input embedding, for
    a process that holds no copy of the target), an EAGLE-3 one sharing that embedding (`DrafterKind.load`)."""
    return kind_of_dir(path).load(path, target_vocab_size, dtype, device, target, embed)


def resolve_pair(cfg, with_drafter: bool = True, target_weights: bool = True, over_target: bool = False) -> Pair:
    """Load the target and drafter named by a `dvi.config.ModelConfig` (see `pair_dirs`). The drafter's
    tokenizer must match the target's. Both go to `model.device` in `model.dtype` (checked before anything loads).
    `target_weights=False`: the target is its skeleton (`target_skeleton`) and the drafter stays on the CPU, for an
    engine that loads the target itself (vLLM's, serve.engine=vllm-server). An EAGLE-3 drafter's directory (`kind_of_dir`) gives a
    `dvi.eagle3.Eagle3Drafter` (its version and kind as a Drafter's; the target's embedding read from `target_dir`),
    which vLLM (method eagle3) and dvi's own engine serve; with `over_target` (the trainer's) and the target's
    weights, a `Drafter` over the loaded target instead (`load_any_drafter`)."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    target_dir, drafter_dir = pair_dirs(cfg, with_drafter)
    tokenizer = check_pair_dirs(target_dir, drafter_dir)
    if target_weights:
        target = load_causal_lm(target_dir, "target", dtype, device)
    else:
        target, device = target_skeleton(target_dir, dtype), torch.device("cpu")
    drafter = None
    if drafter_dir is not None:
        kind, vocab = kind_of_dir(drafter_dir), int(target.config.vocab_size)
        if over_target and target_weights:
            drafter = kind.load(drafter_dir, vocab, dtype, device, target=target)
        else:
            drafter = kind.load_served(drafter_dir, target_dir, vocab, dtype, device)
    return Pair(target, tokenizer, drafter, target_dir, drafter_dir)
