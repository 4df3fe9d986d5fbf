"""A dvi-built EAGLE-3 drafter (`dvi.eagle3.build_eagle3`, speculators format) served by plain vLLM 0.32 (the CPU
build, fp32, eager) with `method: "eagle3"`: greedy answers equal the target's own, vLLM drafted with it, and it
accepted exactly the drafts that dvi's `Eagle3Drafter` makes from the same weights (`simulated_counts`: vLLM's
drafting loop replayed on the target's greedy answer), so vLLM computes what dvi trains.

Then dvi's replica over vLLM's engine (serve.engine=vllm) with an EAGLE-3 model.drafter: it serves the target's
answers, each Result carrying the target's features of every token vLLM fed (the aux hidden states its forwards
computed for the drafter: what records carry to a trainer that holds no target), a published EAGLE-3 version is
swapped into vLLM's running draft model (its drafts are the new weights', as dvi computes them), the live judge rolls
it back and the first weights draft again, exactly as before.

One vLLM start per test (about a minute each on 2 cores).
"""

from __future__ import annotations

import gc

import pytest
import torch

from replica_fixtures import service_config

from dvi import store
from dvi.config import SpecConfig, StreamConfig, SwapConfig, VllmConfig
from dvi.control import DrafterPublished
from dvi.eagle3 import Eagle3Drafter, build_eagle3, load_eagle3, target_features, target_ids
from dvi.engine_api import Request
from dvi.models import load_causal_lm
from dvi.pairs import resolve_pair
from dvi.serving.replica import Replica
from dvi.serving.vllm_engine import import_vllm, set_vllm_env

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


def noisy_copy(drafter: Eagle3Drafter, noise: float, seed: int) -> dict[str, torch.Tensor]:
    """`drafter`'s checkpoint tensors with relative Gaussian noise `noise` on every matrix (10: unrelated weights)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g) * noise * v.std() if v.is_floating_point() and v.ndim == 2 else v
            for k, v in drafter.weights().items()}


def test_a_replica_on_vllm_swaps_an_eagle3_version_in_and_rolls_it_back(demo_target_dir, demo_drafter_dir, tmp_path, capfd):
    """e0000 (configured, built from the target) drafts; e0001 (unrelated weights) is announced, swapped into vLLM's
    running draft model and judged on live traffic (its drafts are never accepted): rolled back, e0000 drafts again.
    Each drafter's drafts on the repeating prompt, alone in vLLM's batch, are counted as dvi's `Eagle3Drafter`
    drafts from the same weights; a layer drafter's version is refused (`load`) and e0000 serves on."""
    configured = build_eagle3(demo_target_dir, tmp_path / "configured", vocab_n=2048, texts=TEXTS, layer_ids=(2, 15, 29),
                              version="e0000")
    store_root = tmp_path / "store"
    first = load_eagle3(configured)
    weights = noisy_copy(first, noise=10.0, seed=1)
    noisy = store.publish(store_root, "e0001", weights, configured, {"parent": "e0000"})
    unrelated = load_eagle3(configured)
    unrelated.load_state_dict(weights, strict=False)
    answers = target_greedy(demo_target_dir, PROMPTS, N_TOKENS + K)
    reference = [a[:N_TOKENS] for a in answers]
    target = load_causal_lm(demo_target_dir, "target")
    repeating = len(PROMPTS) - 1
    expected = {v: simulated_counts(d, target, PROMPTS[repeating], answers[repeating], N_TOKENS, K)
                for v, d in (("e0000", first), ("e0001", unrelated))}
    # the target's features of each prompt and answer but its last token (never fed), as Hugging Face computes them
    features = [target_features(target, torch.tensor([p + reference[i][:-1]]), (2, 15, 29))[0] for i, p in enumerate(PROMPTS)]
    print("simulated (drafts, accepted) on the repeating prompt:", expected)
    assert expected["e0000"][1] > 0 and expected["e0001"][1] == 0
    del target, first, unrelated

    cfg = service_config(StreamConfig(), (demo_target_dir, configured), store_root, engine="vllm",
                         spec=SpecConfig(k=K, adaptive=False), vllm=VllmConfig(cpu_kv_cache_gb=1, enforce_eager=True),
                         swap=SwapConfig(store=str(store_root), initial="none", window_tokens=48, baseline_tokens=24,
                                         rollback_margin=0.0))
    service = Replica(cfg, resolve_pair(cfg.model, target_weights=False)).start()  # no control channel: on_control by hand
    try:
        def run(prompts: list[int]):
            jobs = [service.submit(Request(PROMPTS[i], max_new_tokens=N_TOKENS, ignore_eos=True)) for i in prompts]
            results = [j.future.result(300) for j in jobs]
            assert [r.token_ids for r in results] == [reference[i] for i in prompts]  # whichever drafter drafts
            for i, r in zip(prompts, results):  # vLLM's (bf16) features of every token fed: Hugging Face's, to bf16's rounding
                assert r.features_layers == (2, 15, 29) and r.features_start == 0 and r.features.shape == features[i].shape
                cos = torch.nn.functional.cosine_similarity(r.features.float().unflatten(-1, (3, -1)),
                                                            features[i].unflatten(-1, (3, -1)), dim=-1)  # [rows, layers]
                assert cos.min() > 0.98, (i, cos.min())
            return results

        def drafts(version: str) -> list[tuple[int, list[int]]]:
            """The drafts of `version` on the repeating prompt, alone in the batch: checked against dvi's count."""
            rounds = [x for x in run([repeating])[0].rounds if x.k]
            assert {x.drafter_version for x in rounds} == {version}
            assert (len(rounds), sum(x.accepted for x in rounds)) == expected[version]
            return [(x.position, x.drafted) for x in rounds]

        assert service.engine.drafter.version == "e0000" and service.metrics.version == "e0000"
        run(list(range(len(PROMPTS))))
        before = drafts("e0000")  # the latest traffic the next drafter is judged against

        service.on_control(DrafterPublished(noisy.version, str(noisy.path), noisy.sha256, parent="e0000"))
        assert service.engine.drafter.version == "e0001" and service.metrics.version == "e0001"
        assert drafts("e0001") != before
        assert service.check_rollout() == "rollback"
        assert service.engine.drafter.version == "e0000" and service.metrics.version == "e0000" and "e0001" in service.rejected

        layer = store.publish(store_root, "e0002", load_causal_lm(demo_drafter_dir, "drafter").state_dict(), demo_drafter_dir,
                              {"parent": "test"})
        service.on_control(DrafterPublished(layer.version, str(layer.path), layer.sha256))
        assert service.metrics.events["refused:load"] == 1 and service.engine.drafter.version == "e0000"
        assert drafts("e0000") == before  # the first weights are back in vLLM's draft model
        # the embedding (the target's) and the rotary embedding are in no EAGLE-3 checkpoint: no warning of them
        assert "Failed to load weights" not in "".join(capfd.readouterr())
    finally:
        service.close()
        gc.collect()
