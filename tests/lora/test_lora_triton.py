"""The batched LoRA Triton kernels (rayllm/lora/triton_kernels.py) against the CPU LoRA path
(LoRALinear.apply: padded bmm or loop over slots), on mixed batches of base tokens and several adapters
of different ranks, odd token counts, every projection. Without a GPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set before the import); the GPU lane runs this file natively on CUDA.
Adapters are random (random_peft_adapter); the model's weights are random too (only its shapes matter)."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from rayllm.layers.linear import TPGroup  # noqa: E402
from rayllm.lora.files import random_peft_adapter  # noqa: E402
from rayllm.lora.layers import LoRAManager  # noqa: E402
from rayllm.lora.triton_kernels import group_tokens, lora_apply  # noqa: E402
from rayllm.models.llama import LlamaForCausalLM  # noqa: E402
from rayllm.schema.config import LlamaArch, LoRAConfig  # noqa: E402

ARCH = LlamaArch(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                 tie_word_embeddings=True)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def cpu_setup(tmp_path_factory):
    """The CPU path's manager (fp32, CPU) with three adapters: ranks 8, 2 (q and down only) and 5."""
    model = LlamaForCausalLM(ARCH, TPGroup(), None)
    manager = LoRAManager(model, LoRAConfig(max_loras=3, max_lora_rank=8), torch.float32, torch.device("cpu"))
    root = tmp_path_factory.mktemp("lora")
    for slot, (lora_id, rank, targets) in enumerate([(7, 8, ALL), (8, 2, ("q_proj", "down_proj")), (9, 5, ALL)],
                                                    start=1):
        manager.load(slot, lora_id, random_peft_adapter(str(root / str(lora_id)), ARCH, rank=rank, seed=lora_id,
                                                        targets=targets))
    return model, manager


@pytest.mark.parametrize("lora_ids, lens", [
    ([0, 7, 8, 0, 9, 7], [1, 1, 1, 1, 1, 1]),  # decode step, base rows between adapters
    ([7, 0, 9], [37, 2, 1]),  # odd prefill beside short rows, more than one 16-row tile for one slot
    ([8, 8], [3, 4]),  # one adapter for every row
    ([9, 0, 8, 7, 9], [5, 3, 17, 1, 2]),  # a slot split in two groups, odd counts
    ([0, 0], [2, 3]),  # base only
])
def test_kernels_match_the_cpu_lora_path(cpu_setup, lora_ids, lens):
    model, manager = cpu_setup
    manager.set_batch(lora_ids, lens)
    total = sum(lens)
    slots = torch.tensor([manager.id_to_slot.get(i, 0) for i, n in zip(lora_ids, lens, strict=True)
                          for _ in range(n)], dtype=torch.int32)
    dev = torch.device("cuda" if CUDA else "cpu")
    groups = group_tokens(slots.to(dev), manager.config.max_loras + 1)
    layer = model.layers[0]
    for lin, fan_in in [(layer.self_attn.qkv_proj, 64), (layer.self_attn.o_proj, 64),
                        (layer.mlp.gate_up_proj, 64), (layer.mlp.down_proj, 96)]:
        g = torch.Generator().manual_seed(total)
        x = torch.randn(total, fan_in, generator=g)
        base = torch.randn(total, lin.lora.b.shape[1], generator=g)
        want = lin.lora.apply(x, base.clone())
        got = lora_apply(x.to(dev), lin.lora.a.to(dev), lin.lora.b.to(dev), base.to(dev), groups,
                         lin.lora.widths.to(dev))
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
        base_rows = slots == 0
        assert torch.equal(got.cpu()[base_rows], base[base_rows])  # base tokens untouched


def test_widths_follow_rank_and_targets(cpu_setup):
    _, manager = cpu_setup
    layer = manager.layers[0]
    # slot 1: rank 8 on all; slot 2: rank 2 on q and down only; slot 3: rank 5 on all
    assert layer.self_attn.qkv_proj.lora.widths.tolist() == [0, 24, 6, 15]
    assert layer.self_attn.o_proj.lora.widths.tolist() == [0, 8, 0, 5]
    assert layer.mlp.gate_up_proj.lora.widths.tolist() == [0, 16, 0, 10]


def test_grouping_is_stable_and_counts_slots():
    g = group_tokens(torch.tensor([2, 0, 2, 1, 0, 2], dtype=torch.int32), 4)
    assert g.sorted_tokens.tolist() == [1, 4, 3, 0, 2, 5]
    assert g.counts.tolist() == [2, 1, 3, 0] and g.starts.tolist() == [0, 2, 3, 6]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_bf16_kernels_within_rounding_of_fp32(cpu_setup, dtype):
    """bf16 buffers (what CUDA serves): within bf16 rounding of the fp32 CPU path."""
    model, manager = cpu_setup
    lin = model.layers[0].mlp.down_proj.lora
    slots = torch.tensor([1, 0, 3, 3, 2, 1, 0], dtype=torch.int32)
    manager.set_batch([7, 0, 9, 8, 7, 0], [1, 1, 2, 1, 1, 1])
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    want = lin.apply(x, torch.zeros(7, 64))
    got = lora_apply(x.to(dtype), lin.a.to(dtype), lin.b.to(dtype), torch.zeros(7, 64, dtype=dtype),
                     group_tokens(slots, 4), lin.widths)
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=0.02)


@pytest.mark.skipif(CUDA, reason="the CPU path of DecodeGraphs (capture=False); the GPU lane captures: test_gpu_lora.py")
def test_decode_graphs_replay_the_base_variant_unless_a_row_has_an_adapter(tmp_path):
    """DecodeGraphs with adapters enabled has two variants per batch size: a step of base-model rows only
    runs the one without LoRA kernels, a step with any adapter row the one whose slots are an input (here
    both eagerly, capture=False; the kernels in Triton's interpreter). Each equals the runner's eager path."""
    from rayllm.attention.sdpa import SDPAAttention
    from rayllm.runner.cuda_graphs import DecodeGraphs
    from rayllm.runner.model_runner import ModelRunner
    from rayllm.schema.step import SeqStep, StepInput

    torch.manual_seed(4)
    model = LlamaForCausalLM(ARCH, TPGroup(), SDPAAttention())
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.float32, torch.device("cpu"))
    manager.load(1, 7, random_peft_adapter(str(tmp_path / "a"), ARCH, rank=8, seed=7, targets=ALL))
    bs, blocks, width = 4, 12, 4
    caches = [(torch.randn(2, blocks + 1, bs, 16), torch.randn(2, blocks + 1, bs, 16))]
    eager = ModelRunner(model, [tuple(c.clone() for c in caches[0])], bs, 50, torch.device("cpu"), True, lora=manager)
    graph = ModelRunner(model, caches, bs, 50, torch.device("cpu"), True, lora=manager)
    graphs = DecodeGraphs(4, width, bs, blocks, graph.attn_builder, torch.device("cpu"), capture=False, pieces=1)
    graphs.lora = manager
    graphs.capture(graph.model_forward)
    graph.graphs = graphs
    tables = [[3, 5], [1], [7, 2, 9]]
    for lora_ids, variant in (([0, 0, 0], False), ([0, 7, 0], True), ([7, 7, 7], True), ([0, 0, 0], False)):
        step = StepInput([SeqStep(f"s{i}", [5 * i + 2], pos, tables[i], sample=True, lora_slot=lora_ids[i])
                          for i, pos in enumerate((6, 2, 9))])
        before = dict(graphs.replays)
        got = graph.forward(step)
        assert graphs.replays[variant] == before[variant] + 1 and graphs.replays[not variant] == before[not variant]
        torch.testing.assert_close(got, eager.forward(step), atol=1e-4, rtol=1e-4)
    without = ModelRunner(model, [tuple(c.clone() for c in caches[0])], bs, 50, torch.device("cpu"), True)
    base_step = StepInput([SeqStep("b", [3], 6, tables[0], sample=True)])
    manager.clear_batch()
    torch.testing.assert_close(graph.forward(base_step), without.forward(base_step), atol=1e-5, rtol=1e-5)
