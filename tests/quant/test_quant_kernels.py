"""Which kernel a packed linear layer runs (random weights and inputs: this test says so)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayllm.layers import linear as parallel
from rayllm.layers.linear import PackedWeight, RowParallelLinear, TPGroup
from rayllm.layers.linear_method import DENSE, LinearBase, SmallBatchMethod
from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.platforms.cpu.onednn import OneDNNWeight, onednn_available


def layer_with(weight: torch.Tensor, method=DENSE, bias: torch.Tensor | None = None) -> RowParallelLinear:
    """A one-rank linear layer holding `weight` (and `bias`), run by `method`."""
    layer = RowParallelLinear(0, weight.shape[1], weight.shape[0], TPGroup()).to(weight.dtype)
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias, requires_grad=False)
    layer.set_method(method)
    return layer


def test_linear_picks_the_kernel_by_tokens_per_step():
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.05).bfloat16()
    packed = PackedWeight(weight, 4)
    layer = layer_with(weight, SmallBatchMethod(packed, DENSE))
    small = torch.randn(parallel.SMALL_BATCH_TOKENS, 64).bfloat16()
    large = torch.randn(parallel.SMALL_BATCH_TOKENS + 1, 64).bfloat16()
    torch.testing.assert_close(layer(small), packed(small), rtol=0, atol=0)
    torch.testing.assert_close(layer(large), F.linear(large, weight), rtol=0, atol=0)
    # The int4 copy reproduces the weight up to its 4-bit grid (groups of 32 inputs).
    exact = F.linear(small.float(), weight.float())
    assert (packed(small).float() - exact).norm() / exact.norm() < 0.15


@pytest.mark.parametrize("vnni", [False, True])
def test_a_4bit_layer_with_rows_not_in_16s_gets_the_int8_copy(vnni):
    """A 4-bit checkpoint's LM head over a vocab of 32001 (or an uneven tensor-parallel shard): torch's int4
    packing and cpu_qgemm's tiles need the rows in 16s, so its small-batch copy is the per-channel int8 one,
    within int8's rounding of the fp32 product."""
    torch.manual_seed(0)
    weight = (torch.randn(32001, 64) * 0.05).bfloat16()
    packed = PackedWeight(weight, 4, vnni=vnni)
    assert packed.bits == 8 and packed.vnni is None
    x = torch.randn(parallel.SMALL_BATCH_TOKENS, 64).bfloat16()
    exact = F.linear(x.float(), weight.float())
    got = packed(x).float()
    assert got.shape == exact.shape
    assert (got - exact).norm() / exact.norm() < 0.02
    # The layers whose rows are in 16s keep the 4-bit copy.
    assert PackedWeight(weight[:32000], 4, vnni=vnni).bits == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_prepacked_weight_equals_plain_linear(dtype, with_bias):
    """The weight reordered once into oneDNN's layout gives F.linear's result at every batch size
    (the layout is made for 64 rows; 1, 7, 100 and 700 rows run on it too)."""
    if not onednn_available(torch.device("cpu"), dtype):
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    weight = (torch.randn(200, 96) * 0.05).to(dtype)
    bias = torch.randn(200).to(dtype) if with_bias else None
    prepacked = OneDNNWeight(weight)
    for rows in (1, 7, 64, 100, 700):
        x = torch.randn(rows, 96).to(dtype)
        got = layer_with(weight, prepacked, bias)(x)
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5 if dtype == torch.float32 else 0,
                                   atol=1e-5 if dtype == torch.float32 else 0)


def test_small_batches_keep_the_weight_only_kernel_when_prepacked():
    torch.manual_seed(0)
    weight = (torch.randn(96, 64) * 0.05).bfloat16()
    packed = PackedWeight(weight, 4)
    small = torch.randn(parallel.SMALL_BATCH_TOKENS, 64).bfloat16()
    prepacked = OneDNNWeight(weight) if onednn_available(torch.device("cpu"), torch.bfloat16) else DENSE
    layer = layer_with(weight, SmallBatchMethod(packed, prepacked))
    torch.testing.assert_close(layer(small), packed(small), rtol=0, atol=0)


def tiny_model():
    from rayllm.models.llama import LlamaForCausalLM
    from rayllm.schema.config import LlamaArch

    arch = LlamaArch(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4,
                     tie_word_embeddings=True)
    return LlamaForCausalLM(arch, TPGroup(), attn_backend=None).bfloat16()  # random weights: shapes only


def test_lm_head_leaves_the_int4_kernel_sooner():
    model = tiny_model()
    bits = {f"{name}.weight": 4 for name, m in model.named_modules() if isinstance(m, LinearBase)}
    bits["embed_tokens.weight"] = 4
    assert parallel.pack_small_batch_weights(model, bits) == 2 * 4 + 1
    assert model.lm_head.method.small.max_tokens == parallel.SMALL_BATCH_TOKENS_LM_HEAD
    assert model.lm_head.method.small.vnni is None  # the logits keep bf16 activations
    # The other layers: the int4 x int8 kernel where the CPU has VNNI, for larger steps.
    vnni = cpu_qgemm.available()
    assert (model.layers[0].mlp.down_proj.method.small.vnni is not None) == vnni
    assert model.layers[0].mlp.down_proj.method.small.max_tokens == (
        parallel.VNNI_TOKENS if vnni else parallel.SMALL_BATCH_TOKENS)
    # weight_only: torch's int4 kernel (bf16 activations) up to SMALL_BATCH_TOKENS everywhere.
    assert parallel.pack_small_batch_weights(model, bits, vnni=False) == 2 * 4 + 1
    assert model.layers[0].mlp.down_proj.method.small.vnni is None
    assert model.layers[0].mlp.down_proj.method.small.max_tokens == parallel.SMALL_BATCH_TOKENS
    rows = torch.randn(parallel.SMALL_BATCH_TOKENS_LM_HEAD + 1, 64).bfloat16()
    torch.testing.assert_close(model.lm_head(rows), F.linear(rows, model.lm_head.weight), rtol=0, atol=0)


def test_prepack_covers_every_linear_layer_and_the_lm_head():
    from rayllm.layers.linear import prepack_onednn_weights

    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch built without oneDNN")
    model = tiny_model()
    assert prepack_onednn_weights(model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(isinstance(m.method, OneDNNWeight) for m in model.modules() if isinstance(m, LinearBase))


def test_batch_invariant_onednn_rows_do_not_depend_on_the_batch():
    """Batch-invariant layout: each row's result is the same alone (1 row), in any batch size and at
    any offset (including a block that leaves it alone at the end), at 1 and 2 threads, for each weight of
    the shape (the probed block is shared by shape). K=1536 as in
    SmolLM2's down_proj, where oneDNN's one-row kernel rounds differently from its batched one."""
    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch built without oneDNN")
    torch.manual_seed(0)
    weight = torch.randn(576, 1536).bfloat16()
    gemm = OneDNNWeight(weight, batch_invariant=True)
    # Blocks of 1 would be invariant but run a prefill row by row (this weight: 1 before one-row calls
    # were padded to two, 128 since).
    assert gemm.row_block >= 8
    # Layers of one shape share the probe's answer (it depends on oneDNN's kernel for the shape, not on the
    # values): another weight of this shape gets the same block and must be invariant with it too.
    other = OneDNNWeight(3 * torch.randn(576, 1536).bfloat16() + 0.5, batch_invariant=True)
    assert other.row_block == gemm.row_block
    x = torch.randn(300, 1536).bfloat16()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for g in (gemm, other):
                alone = torch.cat([g(x[i : i + 1], None) for i in range(x.shape[0])])
                for rows in (2, 7, g.row_block, g.row_block + 1, 129, 299):
                    for offset in (0, 1):
                        assert torch.equal(g(x[offset : offset + rows], None), alone[offset : offset + rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


def test_int8_one_pass_layers_give_those_layers_one_pass():
    """parallel.cpu.int8_one_pass_layers: the named layer types run cpu_qgemm's kernel with one int8 pass over
    their activations, the others with int8_passes (two); each layer's output is that kernel's at its passes."""
    from rayllm.schema.config import CpuConfig

    cpu = CpuConfig(int8_one_pass_layers=["o_proj", "down_proj"])  # a YAML list
    assert cpu.int8_one_pass_layers == ("o_proj", "down_proj")
    with pytest.raises(ValueError, match="int8_one_pass_layers.*'v_proj'"):
        CpuConfig(int8_one_pass_layers=["v_proj"])
    if not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    model = tiny_model()
    torch.manual_seed(0)
    for p in model.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32) * 0.05)  # random weights
    bits = {f"{name}.weight": 4 for name, m in model.named_modules() if isinstance(m, LinearBase)}
    parallel.pack_small_batch_weights(model, bits, passes=cpu.int8_passes_for)
    rows = torch.randn(16, 128).bfloat16()
    rows[:, 5] *= 40  # an outlier channel: one pass rounds the other channels of its group coarsely
    layer = model.layers[1]
    for module, passes in ((layer.self_attn.qkv_proj, 2), (layer.self_attn.o_proj, 1), (layer.mlp.gate_up_proj, 2),
                           (layer.mlp.down_proj, 1)):
        assert module.method.small.vnni.passes == passes
        x = rows[:, : module.weight.shape[1]]
        same = PackedWeight(module.weight.data, 4, vnni=True, passes=passes)(x)
        other = PackedWeight(module.weight.data, 4, vnni=True, passes=3 - passes)(x)
        torch.testing.assert_close(module.method.small(x), same, rtol=0, atol=0)
        assert not torch.equal(same, other)
