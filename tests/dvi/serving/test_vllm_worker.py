"""The parts of dvi's vLLM worker extension that need no engine: the rejection sampler's `expand_kernel` in torch
(against a plain loop), registered in place of the CPU build's stand-in, which leaves a float tensor it expands
uninitialized (a sampled request's temperature and top-p per drafted token: its drafts verified against NaN)."""

from __future__ import annotations

import pytest
import torch

from dvi.serving.vllm_worker import expand_tokens, fix_cpu_expand


def reference(values: list, counts: list[int], replace_from, replace_to) -> list:
    out = []
    for v, n in zip(values, counts):
        out += [replace_to if v == replace_from else v] * n
    return out


@pytest.mark.parametrize("values, counts", [([0.7, 0.0, 1.3], [3, 0, 2]), ([5, 0, 2, 9], [1, 4, 0, 1])])
def test_expand_tokens_puts_each_requests_value_in_its_tokens_places(values, counts):
    x = torch.tensor(values)
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    out = torch.full((sum(counts) + 2,), -7, dtype=x.dtype)  # room past the tokens stays as it was
    expand_tokens(out, x, cu, 0, 1)
    assert out[: sum(counts)].tolist() == pytest.approx(reference(values, counts, 0, 1))
    assert out[sum(counts):].tolist() == [-7, -7]


def test_vllms_expansion_of_a_float_tensor_is_right_once_fixed():
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    fixed = fix_cpu_expand()
    assert fixed == (current_platform.is_cpu() and not HAS_TRITON)
    temperature = torch.tensor([0.7, 0.0, 1.5])  # the middle request greedy: vLLM replaces 0 by 1 before dividing
    got = expand_batch_to_tokens(temperature, torch.tensor([2, 5, 6], dtype=torch.int32), 6, replace_from=0.0, replace_to=1.0)
    assert got.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0, 1.5])
