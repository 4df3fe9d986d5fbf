"""Statistical checks shared by the tests: goodness of fit of sampled tokens to a distribution, and the target's
distributions of its first two tokens to fit against (computed on the target's device, returned on the CPU)."""

from __future__ import annotations

import torch

from dvi.speculative import logits_to_probs


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit, bins with expected count < 5 pooled; p-value from the chi2 survival."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    if exp[-1] == 0:
        assert obs[-1] == 0, "tokens of zero probability were emitted"
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@torch.inference_mode()
def first_two_token_probs(target, prompt: list[int], temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's warped distributions [V] of the first token after `prompt` and of the second, P(second) =
    sum_t p1(t) p2(. | t), every token of its vocabulary tried as the first."""
    vocab, device = int(target.config.vocab_size), target.device
    one = lambda x: torch.ones(x, dtype=torch.float32, device=device)  # noqa: E731
    p1 = logits_to_probs(target(torch.tensor([prompt], device=device)).logits[:, -1], one(1) * temperature, one(1) * top_p)[0]
    ctx = torch.tensor([prompt + [t] for t in range(vocab)], device=device)
    p2 = logits_to_probs(target(ctx).logits[:, -1], one(vocab) * temperature, one(vocab) * top_p)  # [V, V]
    return p1.cpu(), (p1.unsqueeze(1) * p2).sum(0).cpu()
