"""A linear layer's weight method (rayllm/layers/linear_method.py): the layer runs whatever method it was given,
a small-batch copy keeps its dense path behind it, and a method with weights of its own releases the layer's
dense weight (its shape stays). Random weights and inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayllm.layers.linear import SMALL_BATCH_TOKENS, PackedWeight, QKVParallelLinear, TPGroup
from rayllm.layers.linear_method import DENSE, DenseMethod, SmallBatchMethod
from rayllm.quant.methods import Int8GroupWeight


def qkv_layer() -> QKVParallelLinear:
    torch.manual_seed(0)
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True, tp=TPGroup()).bfloat16()
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.05)
    return layer


def test_dense_is_the_default_and_adds_the_bias():
    layer = qkv_layer()
    x = torch.randn(5, 64).bfloat16()
    assert isinstance(layer.method, DenseMethod)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_a_small_batch_copy_keeps_the_dense_path_behind_it():
    layer = qkv_layer()
    small = PackedWeight(layer.weight.data, 8)
    layer.set_method(SmallBatchMethod(small, DENSE))
    x = torch.randn(SMALL_BATCH_TOKENS + 3, 64).bfloat16()
    torch.testing.assert_close(layer(x[:SMALL_BATCH_TOKENS]), small(x[:SMALL_BATCH_TOKENS]) + layer.bias, rtol=0, atol=0)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    marker = SmallBatchMethod(small, DENSE)  # any method stands in for a dense path here
    layer.set_large_batch_method(marker)
    assert layer.method.small is small and layer.large_batch_method is marker


def test_a_method_with_its_own_weights_releases_the_dense_weight():
    layer = qkv_layer()
    n, k = layer.weight.shape
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // 32) / 50
    method = Int8GroupWeight(q, scale, torch.zeros_like(scale), torch.bfloat16)
    layer.set_method(method)
    assert layer.weight.device.type == "meta" and tuple(layer.weight.shape) == (n, k)  # shape-only (LoRA reads it)
    assert layer.large_batch_method is None
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(layer(x), F.linear(x, method.dense(torch.bfloat16)) + layer.bias, rtol=0, atol=0)
    with pytest.raises(ValueError, match="every step size"):
        layer.set_large_batch_method(DENSE)
