"""Which kernel a packed linear layer runs (random weights and inputs: this test says so)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_parallel import parallel
from model_parallel.parallel import PackedWeight, linear


def test_linear_picks_the_kernel_by_tokens_per_step():
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.05).bfloat16()
    packed = PackedWeight(weight, 4)
    small = torch.randn(parallel.SMALL_BATCH_TOKENS, 64).bfloat16()
    large = torch.randn(parallel.SMALL_BATCH_TOKENS + 1, 64).bfloat16()
    torch.testing.assert_close(linear(small, weight, None, packed), packed(small), rtol=0, atol=0)
    torch.testing.assert_close(linear(large, weight, None, packed), F.linear(large, weight), rtol=0, atol=0)
    # The int4 copy reproduces the weight up to its 4-bit grid (groups of 32 inputs).
    exact = F.linear(small.float(), weight.float())
    assert (packed(small).float() - exact).norm() / exact.norm() < 0.15
