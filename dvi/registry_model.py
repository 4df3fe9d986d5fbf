"""A registered drafter version as an MLflow pyfunc model, so the registry's own tooling loads it:
`mlflow.pyfunc.load_model("models:/dvi-drafter@production")`.

`dvi.tracking` writes an `MLmodel` file beside each drafter it logs to a run (`dvi.tracking.mlmodel`); that file
names this module as the pyfunc loader, and MLflow calls `_load_pyfunc(path)` on the downloaded directory. The loaded
model's `predict` takes prompts (a string, a list of token ids, or a list of either) and returns, per prompt, the
drafter's greedy continuation: `{"token_ids": [...], "text": ...}` (`params={"max_new_tokens": n}`, default 8),
which is what the drafter would propose to the target. An EAGLE-3 drafter (`dvi.eagle3`) drafts from the target's
features: its target is loaded from the verifier path its config.json names (the target it was built for, on the
machine that loads it), and its continuation is its own chain of drafts after the prompt, as vLLM's drafting loop
runs it (the first from the target's features of the prompt, each next from its own output). This module knows a
drafter directory and MLflow's pyfunc loader contract; nothing about training, serving or the registry's aliases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dvi.errors import DviError
from dvi.drafter_kinds import kind_of_dir
from dvi.models import Drafter, load_causal_lm, load_tokenizer


class DrafterModel:
    """A drafter loaded from its directory, answering `predict` (see the module docstring)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        config = json.loads((p / "config.json").read_text())
        self.kind = kind = kind_of_dir(p)
        self.target = None
        if kind.reads_features:  # the target it drafts from is the verifier its config.json names
            self.target = load_causal_lm(config["speculators_config"]["verifier"]["name_or_path"], "target")
        vocab = int(self.target.config.vocab_size if self.target is not None else config["vocab_size"])
        self.drafter: Drafter = kind.load(p, vocab, torch.float32, "cpu", target=self.target)
        self.tokenizer = load_tokenizer(p, "drafter") if (p / "tokenizer_config.json").exists() else None

    @torch.inference_mode()
    def predict(self, model_input: Any, params: dict | None = None) -> list[dict]:
        n = int((params or {}).get("max_new_tokens", 8))
        prompts = model_input if isinstance(model_input, list) and model_input and not isinstance(model_input[0], int) else [model_input]
        out = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise DviError("this drafter was logged without its tokenizer: give token ids")
                ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = [int(t) for t in prompt]
            new = self.kind.greedy_drafts(self.drafter, ids, n, self.target)
            out.append({"token_ids": new, "text": self.tokenizer.decode(new) if self.tokenizer is not None else None})
        return out


def _load_pyfunc(path: str) -> DrafterModel:
    """MLflow's pyfunc loader entry point (the MLmodel file's `loader_module`)."""
    return DrafterModel(path)
