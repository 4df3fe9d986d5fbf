"""dvi's own engine drafting with an EAGLE-3 drafter (`dvi.eagle3.Eagle3Drafter`) on tiny random-weight Llamas.

References are plain: the target's own `generate` (greedy), and for every draft a fresh, uncached run of the drafter
over the target's features of the whole sequence so far (`reference_drafts`: each position's feature beside the token
after it, drafting at the last, then its own pre-norm output fed back). Equal drafts mean the engine's drafter cache,
its feature bookkeeping (prefill beside other rows, accepted prefixes, rolled-back drafts, holes, rows leaving) and
the rebuild after a hot swap are right. Sampling is checked against the target's distribution. Then the demo target
with an EAGLE-3 drafter as `dvi drafter init --kind eagle3` builds it, whose drafts the target often accepts.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dvi.config import SpecConfig
from dvi.eagle3 import Eagle3Drafter, build_eagle3, init_from_target, layer_config, load_for_target, target_features, target_ids
from dvi.engine import SpeculativeEngine
from dvi.engine_api import Request
from dvi.errors import DviError
from dvi.models import Drafter, load_causal_lm
from stat_checks import chi_square_pvalue, first_two_token_probs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5], [1, 2, 3, 4, 5], list(range(10, 27)), [(7 * i + 3) % 97 for i in range(40)]]
NEW = 24


@torch.no_grad()
def eagle_drafter(target, seed: int, noise: float, version: str, layer_ids=(0, 1, 2), vocab: int = 64) -> Eagle3Drafter:
    """An EAGLE-3 drafter of `target` over `vocab` of its ids: the target's last layer over its top features
    (`init_from_target`), with relative Gaussian noise `noise` on every matrix but the shared embedding."""
    device, target = target.device, copy.deepcopy(target).cpu()  # built on the CPU, then moved to the target's device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(int(target.config.vocab_size), generator=g)[:vocab].sort().values
    d = Eagle3Drafter(layer_config(target.config), vocab, layer_ids, embed=target.get_input_embeddings().weight.detach())
    init_from_target(d, target, ids)
    for name, p in d.named_parameters():
        if p.ndim == 2 and not name.startswith("embed_tokens"):
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp(min=0.02))
    d.version = version
    return d.eval().to(device)


@pytest.fixture(scope="module")
def eagle(tiny_target) -> Eagle3Drafter:
    return eagle_drafter(tiny_target, seed=1, noise=0.3, version="e-a")


@torch.no_grad()
def reference_drafts(drafter: Eagle3Drafter, target, seq: list[int], k: int) -> list[int]:
    """The k greedy drafts after `seq`, uncached: the drafter reads the target's features of every position but the
    last beside the token after it, drafts at the last, then feeds its own pre-norm output back k - 1 times."""
    x = torch.tensor([seq], device=target.device)
    hidden, tokens, vocab, out = drafter.fuse(target_features(target, x[:, :-1], drafter.layer_ids)), x[:, 1:], target_ids(drafter.d2t), []
    for _ in range(k):
        logits, prenorm = drafter(hidden, tokens)
        out.append(int(vocab[logits[0, -1].argmax()]))
        hidden, tokens = torch.cat([hidden, prenorm[:, -1:]], 1), torch.cat([tokens, tokens.new_tensor([[out[-1]]])], 1)
    return out


def check_drafts(results, target, drafters: dict[str, Eagle3Drafter]) -> tuple[int, int]:
    """Every drafting round's drafts equal `reference_drafts` of the drafter whose version drafted them; a request's
    first round (its prefill: no features of it yet) drafts nothing. (drafted, accepted) over all rounds."""
    drafted = accepted = 0
    for res in results:
        assert res.rounds[0].k == 0
        for r in res.rounds:
            if r.k:
                seq = res.prompt_ids + res.token_ids[: r.position]
                assert r.drafted == reference_drafts(drafters[r.drafter_version], target, seq, r.k), (res.request_id, r.position)
                drafted, accepted = drafted + r.k, accepted + r.accepted
    return drafted, accepted


def target_greedy(target, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=target.device)
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("held", [False, True], ids=["bare", "held-by-a-Drafter"])
@pytest.mark.parametrize("spec", [SpecConfig(k=3, adaptive=False), SpecConfig(k=1, adaptive=False), SpecConfig()],
                         ids=["k3", "k1", "adaptive"])
def test_greedy_with_an_eagle3_drafter_is_the_targets_and_every_draft_is_the_reference(tiny_target, eagle, spec, held):
    drafter = Drafter(model=eagle, version=eagle.version, vocab_map=target_ids(eagle.d2t)) if held else eagle
    engine = SpeculativeEngine(tiny_target, drafter, spec, max_batch=2)  # rows join and leave mid-batch
    if spec.adaptive:
        costs = engine.warm_up()
        assert costs["draft_step_s"]["b1"] > 0 and costs["verify_s"]["b1/k0"] > 0
    results = engine.generate([Request(p, max_new_tokens=NEW) for p in PROMPTS])
    for res, p in zip(results, PROMPTS):
        assert res.token_ids == target_greedy(tiny_target, p, NEW)
    drafted, accepted = check_drafts(results, tiny_target, {eagle.version: eagle})
    print(f"{spec}: {accepted}/{drafted} drafts accepted")
    assert drafted and 0 < accepted < drafted  # drafts both kept and rolled back


def test_a_hot_swap_mid_answer_drafts_from_the_target_features_of_the_whole_sequence(tiny_target, eagle):
    other = eagle_drafter(tiny_target, seed=2, noise=0.2, version="e-b", layer_ids=(1, 2))  # other aux layers, other vocabulary
    engine = SpeculativeEngine(tiny_target, eagle, SpecConfig(k=3, adaptive=False), max_batch=4)
    batch = engine.decoding()
    for i, p in enumerate(PROMPTS):
        batch.add(Request(p, max_new_tokens=NEW), key=i)
    done = {}
    for _ in range(4):
        done.update(batch.step())
    engine.swap_drafter(other)
    while batch.size:
        done.update(batch.step())
    results = [done[i] for i in range(len(PROMPTS))]
    for res, p in zip(results, PROMPTS):
        assert res.token_ids == target_greedy(tiny_target, p, NEW)
        assert res.drafter_versions == ["e-a", "e-b"]
    drafted, accepted = check_drafts(results, tiny_target, {"e-a": eagle, "e-b": other})
    assert 0 < accepted < drafted


def test_a_row_that_joins_beside_one_the_drafter_has_not_seen_yet_drafts_from_its_features(tiny_target, eagle):
    """The drafter's cache loses every slot: a long answer that filled it is cancelled as a request joins, whose
    prefill round drafts nothing, and the compaction after it drops the holes. A request joining then is fed beside
    the one left, from the round both draft."""
    long = [(5 * i + 1) % 97 for i in range(80)]  # more drafter slots than the compaction's slack
    engine = SpeculativeEngine(tiny_target, eagle, SpecConfig(k=3, adaptive=False), max_batch=3)
    batch = engine.decoding()
    batch.add(Request(long, max_new_tokens=NEW), key="long")
    batch.step(), batch.step()
    batch.add(Request(PROMPTS[1], max_new_tokens=NEW), key=1)
    batch.cancel("long")
    done = dict(batch.step())
    assert list(done) == ["long"] and batch.dft.valid.shape[1] == 0  # the row left has only pending tokens
    batch.add(Request(PROMPTS[2], max_new_tokens=NEW), key=2)
    while batch.size:
        done.update(batch.step())
    for i in (1, 2):
        assert done[i].token_ids == target_greedy(tiny_target, PROMPTS[i], NEW)
    drafted, accepted = check_drafts([done[1], done[2]], tiny_target, {eagle.version: eagle})
    assert drafted and 0 < accepted < drafted


def test_sampled_tokens_with_an_eagle3_drafter_follow_the_target(tiny_target, eagle):
    """Thousands of seeded copies of one prompt: the second token (drafted by EAGLE-3 from the target's features of
    the prompt and the first token, then accepted or recovered) follows the target's warped distribution."""
    prompt, temperature, top_p, rows = PROMPTS[1], 1.3, 0.9, 3000
    engine = SpeculativeEngine(tiny_target, eagle, SpecConfig(k=2, adaptive=False, topk_logprobs=0), max_batch=rows)
    results = engine.generate([Request(prompt, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=s) for s in range(rows)])
    assert all(r.rounds[0].k == 0 and r.rounds[1].k == 1 for r in results)  # the prefill, then one draft (budget 3)
    accepted = sum(r.rounds[1].accepted for r in results)
    assert 0 < accepted < rows
    _, p_second = first_two_token_probs(tiny_target, prompt, temperature, top_p)
    counts = torch.bincount(torch.tensor([r.token_ids[1] for r in results]), minlength=97).double()
    assert bool((counts[p_second == 0] == 0).all()), "tokens outside the top-p set were emitted"
    pval = chi_square_pvalue(counts, p_second)
    assert pval > 1e-4, f"second token: chi-square p-value {pval:.2e}"


def test_an_eagle3_drafter_that_reads_layers_the_target_lacks_is_refused(tiny_target, eagle):
    engine = SpeculativeEngine(tiny_target, None, SpecConfig())
    far = Eagle3Drafter(layer_config(tiny_target.config), 64, (0, 1, 7), embed=tiny_target.get_input_embeddings().weight.detach())
    far.version = "e-far"
    with pytest.raises(DviError, match=r"'e-far' reads aux layers \[0, 1, 7\].*the target has layers 0..3"):
        engine.swap_drafter(far)
    assert engine.drafter is None


@pytest.mark.real_model
def test_the_demo_target_drafted_by_an_eagle3_drafter_answers_its_own_greedy_tokens(demo_target_dir, tmp_path):
    """Built over the target's last layer (aux layers 2, 15, 29), the untrained drafter's first draft is the target's
    own prediction one position late: accepted where the target repeats itself ("ha ha ha ..."), several drafts a
    round; every draft is still the reference's and the answer the target's own."""
    prompts = [[1, 504, 3458, 282, 4371, 314], [1, 2683, 13888, 30, 28], [3250, 421, 421, 421, 421]]
    drafter_dir = build_eagle3(demo_target_dir, tmp_path / "e3", vocab_n=2048, texts=["def main():\n    return 0\n"],
                               layer_ids=(2, 15, 29))
    target = load_causal_lm(demo_target_dir, "target")
    drafter = load_for_target(drafter_dir, target)
    results = SpeculativeEngine(target, drafter, SpecConfig(k=3, adaptive=False), max_batch=2).generate(
        [Request(p, max_new_tokens=NEW, ignore_eos=True) for p in prompts])
    for res, p in zip(results, prompts):
        assert res.token_ids == target_greedy(target, p, NEW)
    drafted, accepted = check_drafts(results, target, {drafter.version: drafter.model})
    print(f"demo target: {accepted}/{drafted} drafts accepted")
    assert accepted >= 10 and any(r.accepted >= 2 for res in results for r in res.rounds)
