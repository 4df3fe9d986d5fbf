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

from dvi.eagle3 import target_features, target_ids
from dvi.errors import DviError
from dvi.drafter_kinds import kind_of_dir
from dvi.models import Drafter, load_causal_lm, load_tokenizer


class DrafterModel:
    """A drafter loaded from its directory, answering `predict` (see the module docstring)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        config = json.loads((p / "config.json").read_text())
        kind = kind_of_dir(p)
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
            if self.target is not None:
                new = self._eagle3_drafts(ids, n)
                out.append({"token_ids": new, "text": self.tokenizer.decode(new) if self.tokenizer is not None else None})
                continue
            new: list[int] = []
            for _ in range(n):
                logits = self.drafter.model(torch.tensor([ids + new])).logits[0, -1]
                choice = int(logits.argmax())
                new.append(int(self.drafter.vocab_map[choice]) if self.drafter.vocab_map is not None else choice)
            out.append({"token_ids": new, "text": self.tokenizer.decode(new) if self.tokenizer is not None else None})
        return out


    def _eagle3_drafts(self, ids: list[int], n: int) -> list[int]:
        """An EAGLE-3 drafter's n greedy drafts after `ids`: its first pass reads the target's features of each prompt
        position beside the next prompt token (the last one predicts the token after the prompt); each further step
        reads its own output at the last position beside the token it drafted (`dvi.eagle3.ttt_logits`' chain). A
        one-token prompt has no feature before its token: zero features."""
        d = self.drafter.model
        x = torch.tensor([ids])
        if len(ids) > 1:
            feats = target_features(self.target, x[:, :-1], d.layer_ids).to(d.fc.weight.dtype)
            hidden, tokens = d.fuse(feats), x[:, 1:]
        else:
            hidden, tokens = torch.zeros(1, 1, d.config.hidden_size, dtype=d.fc.weight.dtype), x
        positions = torch.arange(tokens.shape[1])[None]
        past, new, vocab = [], [], target_ids(d.d2t)
        for k in range(n):
            logits, hidden, kv = d.step(hidden, tokens, positions + k, past)
            past.append(kv)
            new.append(int(vocab[logits[0, -1].argmax()]))
            tokens = tokens.clone()
            tokens[0, -1] = new[-1]  # the last position's next step reads the token it drafted
        return new


def _load_pyfunc(path: str) -> DrafterModel:
    """MLflow's pyfunc loader entry point (the MLmodel file's `loader_module`)."""
    return DrafterModel(path)
