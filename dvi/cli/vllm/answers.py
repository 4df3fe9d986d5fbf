"""The target's answers for `dvi drafter bootstrap`, generated in batches by a vLLM engine in this process.

`VllmAnswers(target_dir, cfg, dtype, batch)` is an answerer as `trainers.bootstrap.answers_stage` takes one: called
with a batch of `trainers.bootstrap.Job`s (all greedy or all sampled), the stop ids, the most new tokens and a seed, it
returns per job the generated ids (cut after the first stop token, which is kept), and the target's top-k ids and
log-probs at every generated position, as `trainers.bootstrap.answer` (the target's own `generate`) does. vLLM reports
log-probs of the raw logits (its default `raw_logprobs`: temperature 1, unwarped), as serving logs them. `close()`
frees the engine before the trainer takes the machine.

This module knows vLLM's offline `LLM` and the answer's layout (`trainers.bootstrap`'s top-k and sampled temperature);
not records, the corpus or the trainer.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np

from dvi.cli.vllm.engine import import_vllm, set_vllm_env
from dvi.config import VllmConfig
from trainers.bootstrap import SAMPLED_TEMPERATURE, TOPK


class VllmAnswers:
    """A vLLM engine over the target answering bootstrap jobs (see the module docstring)."""

    name = "vllm"

    def __init__(self, target_dir: Path, cfg: VllmConfig, dtype: str, batch: int, max_len: int, topk: int = TOPK,
                 temperature: float = SAMPLED_TEMPERATURE):
        set_vllm_env(cfg)
        self.vllm, self.topk, self.temperature = import_vllm(), topk, temperature
        self.llm = self.vllm.LLM(model=str(target_dir), dtype=dtype, enforce_eager=cfg.enforce_eager, max_model_len=max_len,
                                 max_num_seqs=batch, seed=0, async_scheduling=False, max_logprobs=topk,
                                 gpu_memory_utilization=cfg.gpu_memory_utilization)

    def __call__(self, batch, stops: set[int], new_tokens: int, seed: int, pad_id: int | None = None):
        sampled = batch[0].sample > 0
        params = [self.vllm.SamplingParams(temperature=self.temperature if sampled else 0.0, top_p=1.0,
                                           max_tokens=new_tokens, logprobs=self.topk, seed=seed + i if sampled else None,
                                           stop_token_ids=sorted(stops), detokenize=False)
                  for i in range(len(batch))]
        outputs = self.llm.generate([{"prompt_token_ids": list(j.ids)} for j in batch], params, use_tqdm=False)
        return [self._answer(o.outputs[0]) for o in outputs]

    def _answer(self, out):
        """(generated ids, [n, topk] ids, [n, topk] log-probs) of one completion: each position's `topk` best by rank
        (vLLM adds the sampled token where it is not among them)."""
        gen = list(out.token_ids)
        ids = np.zeros((len(gen), self.topk), np.int32)
        lps = np.zeros((len(gen), self.topk), np.float32)
        for t, by_id in enumerate(out.logprobs or []):
            best = sorted((lp.rank, i, lp.logprob) for i, lp in by_id.items() if lp.rank is not None and lp.rank <= self.topk)
            if len(best) != self.topk:
                raise RuntimeError(f"vLLM gave {len(best)} of the {self.topk} best log-probs at position {t}")
            ids[t] = [i for _, i, _ in best]
            lps[t] = [lp for _, _, lp in best]
        return gen, ids, lps

    def close(self) -> None:
        """The engine's memory back to the machine (the trainer comes next)."""
        del self.llm
        gc.collect()
