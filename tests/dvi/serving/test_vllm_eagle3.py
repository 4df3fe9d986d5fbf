"""A dvi-built EAGLE-3 drafter (`dvi.eagle3.build_eagle3`, speculators format) served by plain vLLM 0.32 (the CPU
build, fp32, eager) with `method: "eagle3"`: greedy answers equal the target's own, vLLM drafted with it, and it
accepted exactly the drafts that dvi's `Eagle3Drafter` makes from the same weights (`simulated_counts`: vLLM's
drafting loop replayed on the target's greedy answer), so vLLM computes what dvi trains.

About a minute on 2 cores (one vLLM start).
"""

from __future__ import annotations

import gc

import pytest
import torch

from dvi.config import VllmConfig
from dvi.eagle3 import Eagle3Drafter, build_eagle3, load_eagle3, target_features, target_ids
from dvi.models import load_causal_lm
from dvi.cli.vllm.engine import import_vllm, set_vllm_env

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

# the last, "ha ha ha ha ha", makes the target repeat itself, which the untrained drafter drafts right: built over the
# target's last layer (aux layers 2, 15, 29), its first draft is the target's prediction of its input token, one
# position late; drafts are accepted where the target repeats a token
PROMPTS = [[1, 504, 3458, 282, 4371, 314], [1, 2683, 13888, 30, 28], [1, 744, 1691, 1201, 314, 253, 1127],
           [3250, 421, 421, 421, 421]]
N_TOKENS = 24
K = 3
TEXTS = ["def main():\n    return 0\n", "The quick brown fox jumps over the lazy dog. " * 20]


@torch.no_grad()
def target_greedy(target_dir, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The target's own greedy continuations (Hugging Face's forward), `n` tokens each, end-of-sequence ignored."""
    target = load_causal_lm(target_dir, "target")
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(n):
            ids = torch.cat([ids, target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        out.append(ids[0, len(p):].tolist())
    return out


@torch.no_grad()
def simulated_counts(drafter: Eagle3Drafter, target, prompt: list[int], answer: list[int], n: int, k: int) -> tuple[int, int]:
    """(drafts, accepted tokens) of greedy decoding of `n` tokens with `drafter` drafting `k` a step, as vLLM's EAGLE-3
    proposer runs it: after each verification the drafter reads the target's features of every position so far with
    the token after each, drafts at the last one, then feeds its own pre-norm output back for k - 1 more (a causal
    forward over the whole sequence equals its KV cache). `answer`: the target's greedy continuation, n + k tokens."""
    full = torch.tensor([prompt + answer])
    feats = drafter.fuse(target_features(target, full, drafter.layer_ids))
    known, drafts, accepted = len(prompt) + 1, 0, 0  # the prefill's token is the first known
    while known - len(prompt) < n:
        hidden, tokens, drafted = feats[:, : known - 1], full[:, 1:known], []
        for _ in range(k):
            logits, prenorm = drafter(hidden, tokens)
            drafted.append(int(target_ids(drafter.d2t)[logits[0, -1].argmax()]))
            hidden, tokens = torch.cat([hidden, prenorm[:, -1:]], 1), torch.cat([tokens, full.new_tensor([[drafted[-1]]])], 1)
        a = next((i for i, d in enumerate(drafted) if d != int(full[0, known + i])), k)
        drafts, accepted, known = drafts + 1, accepted + a, known + a + 1
    return drafts, accepted


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters (vllm:spec_decode_*) from its metrics snapshot."""
    return {m.name: float(m.value) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")}


def test_vllm_serves_a_dvi_eagle3_drafter_with_the_targets_greedy_answers(demo_target_dir, tmp_path):
    drafter_dir = build_eagle3(demo_target_dir, tmp_path / "eagle3", vocab_n=2048, texts=TEXTS, layer_ids=(2, 15, 29))
    answers = target_greedy(demo_target_dir, PROMPTS, N_TOKENS + K)
    reference = [a[:N_TOKENS] for a in answers]
    drafter, target = load_eagle3(drafter_dir), load_causal_lm(demo_target_dir, "target")
    simulated = [simulated_counts(drafter, target, p, a, N_TOKENS, K) for p, a in zip(PROMPTS, answers)]
    print("simulated (drafts, accepted) per prompt:", simulated)
    set_vllm_env(VllmConfig(cpu_kv_cache_gb=1, enforce_eager=True))
    vllm = import_vllm()
    llm = vllm.LLM(model=str(demo_target_dir), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4,
                   seed=0, disable_log_stats=False, async_scheduling=False,
                   speculative_config={"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": K})
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        counters = spec_counters(llm)
    finally:
        del llm
        gc.collect()
    print("vLLM spec-decode counters:", counters)
    assert [list(o.outputs[0].token_ids) for o in outputs] == reference
    drafts, drafted = counters.get("vllm:spec_decode_num_drafts", 0), counters.get("vllm:spec_decode_num_draft_tokens", 0)
    assert drafts > 0 and drafted == K * drafts, counters
    assert drafts == sum(d for d, _ in simulated)
    assert counters.get("vllm:spec_decode_num_accepted_tokens") == sum(a for _, a in simulated) > 0
