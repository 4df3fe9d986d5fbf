"""A registered drafter version as an MLflow pyfunc model, so the registry's own tooling loads it:
`mlflow.pyfunc.load_model("models:/dvi-drafter@production")`.

`dvi.tracking` writes an `MLmodel` file beside each drafter it logs to a run (`dvi.tracking.mlmodel`); that file
names this module as the pyfunc loader, and MLflow calls `_load_pyfunc(path)` on the downloaded directory. The loaded
model's `predict` takes prompts (a string, a list of token ids, or a list of either) and returns, per prompt, the
drafter's greedy continuation: `{"token_ids": [...], "text": ...}` (`params={"max_new_tokens": n}`, default 8),
which is what the drafter would propose to the target. This module knows a drafter directory and MLflow's pyfunc
loader contract; nothing about training, serving or the registry's aliases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dvi.errors import DviError
from dvi.models import Drafter, load_drafter, load_tokenizer


class DrafterModel:
    """A drafter loaded from its directory, answering `predict` (see the module docstring)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        config = json.loads((p / "config.json").read_text())
        self.drafter: Drafter = load_drafter(p, int(config["vocab_size"]))
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
            new: list[int] = []
            for _ in range(n):
                logits = self.drafter.model(torch.tensor([ids + new])).logits[0, -1]
                choice = int(logits.argmax())
                new.append(int(self.drafter.vocab_map[choice]) if self.drafter.vocab_map is not None else choice)
            out.append({"token_ids": new, "text": self.tokenizer.decode(new) if self.tokenizer is not None else None})
        return out


def _load_pyfunc(path: str) -> DrafterModel:
    """MLflow's pyfunc loader entry point (the MLmodel file's `loader_module`)."""
    return DrafterModel(path)
