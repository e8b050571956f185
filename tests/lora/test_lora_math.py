"""The batched LoRA delta (one padded bmm, or a loop over slots) equals per-token B A x; LoRAConfig checks."""

from __future__ import annotations

import pytest
import torch

from rayllm.layers.linear import TPGroup
from rayllm.lora.files import random_peft_adapter, read_peft_adapter
from rayllm.lora.layers import LoRAManager
from rayllm.models.llama import LlamaForCausalLM
from rayllm.schema.config import LlamaArch, LoRAConfig

ARCH = LlamaArch(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                 tie_word_embeddings=True)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = LlamaForCausalLM(ARCH, TPGroup(), None)
    manager = LoRAManager(model, LoRAConfig(max_loras=3, max_lora_rank=8), torch.float32, torch.device("cpu"))
    root = tmp_path_factory.mktemp("lora")
    adapters = {}
    for slot, (lora_id, rank, targets) in enumerate([(7, 8, TARGETS), (8, 2, ("q_proj", "down_proj")),
                                                     (9, 5, TARGETS)], start=1):
        path = random_peft_adapter(str(root / str(lora_id)), ARCH, rank=rank, seed=lora_id, targets=targets)
        manager.load(slot, lora_id, path)
        adapters[lora_id] = read_peft_adapter(path, ARCH, 8).weights
    return model, manager, adapters


def expected_delta(adapters, lora_ids, lens, module_names, x):
    """Per token: concat over the layer's sub-projections of B (A x), zeros for base tokens."""
    shapes = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 96, "up_proj": 96,
              "down_proj": 64}
    rows = []
    t = 0
    for lora_id, n in zip(lora_ids, lens, strict=True):
        for _ in range(n):
            parts = []
            for m in module_names:
                ab = adapters.get(lora_id, {}).get((0, m))
                parts.append(ab[1] @ (ab[0] @ x[t]) if ab is not None else torch.zeros(shapes[m]))
            rows.append(torch.cat(parts))
            t += 1
    return torch.stack(rows)


@pytest.mark.parametrize("lora_ids, lens", [
    ([0, 7, 8, 0, 9, 7], [1, 1, 1, 1, 1, 1]),  # decode step: padded bmm
    ([7, 0, 9], [100, 2, 1]),  # long prefill beside short rows: loop over slots
    ([8, 8], [3, 4]),  # one adapter for every row
    ([0, 0], [2, 2]),  # base only: nothing to add
])
def test_batched_delta_matches_per_token_math(setup, lora_ids, lens):
    model, manager, adapters = setup
    manager.set_batch(lora_ids, lens)
    if lens == [1] * 6:
        assert manager.batch.plan is not None
    if lens[0] == 100:
        assert manager.batch.plan is None and len(manager.batch.groups) == 2
    total = sum(lens)
    layer = model.layers[0]
    cases = [(layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj"), 64),
             (layer.self_attn.o_proj, ("o_proj",), 64),
             (layer.mlp.gate_up_proj, ("gate_proj", "up_proj"), 64),
             (layer.mlp.down_proj, ("down_proj",), 96)]
    for lin, names, fan_in in cases:
        x = torch.randn(total, fan_in, generator=torch.Generator().manual_seed(0))
        want = expected_delta(adapters, lora_ids, lens, names, x)
        got = lin.lora.apply(x, torch.zeros(total, want.shape[1]))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if manager.batch.plan is not None:  # the loop gives the same numbers
            plan, manager.batch.plan = manager.batch.plan, None
            torch.testing.assert_close(lin.lora.apply(x, torch.zeros_like(want)), want, atol=1e-5, rtol=1e-5)
            manager.batch.plan = plan


def test_lora_config_validation():
    cfg = LoRAConfig(max_loras=2, adapters={"b": "/b", "a": "/a"})
    assert cfg.adapters == (("a", "/a"), ("b", "/b")) and cfg.enabled and not LoRAConfig().enabled
    hash(cfg)  # frozen and hashable, like the other config sections
    for bad in (dict(max_lora_rank=65), dict(max_lora_rank=0), dict(max_loras=-1),
                dict(max_loras=1, adapters={"a": "/a", "b": "/b"}), dict(max_loras=1, adapters={"x:y": "/a"})):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)


def test_batch_invariant_delta_of_a_row_does_not_depend_on_its_batch(tmp_path):
    """scheduler.batch_invariant, bf16: a row's output (base output + its adapter's delta) is bit-equal
    alone, beside base rows, beside other adapters' rows, in a long prefill and at any offset; base rows
    are left untouched. The deltas are still B A x."""
    from rayllm.platforms.cpu.onednn import onednn_available

    if not onednn_available(torch.device("cpu"), torch.bfloat16):
        pytest.skip("torch built without oneDNN")
    model = LlamaForCausalLM(ARCH, TPGroup(), None)
    manager = LoRAManager(model, LoRAConfig(max_loras=2, max_lora_rank=8), torch.bfloat16, torch.device("cpu"),
                          batch_invariant=True)
    for slot, (lora_id, rank) in enumerate([(7, 8), (9, 3)], start=1):
        manager.load(slot, lora_id, random_peft_adapter(str(tmp_path / str(lora_id)), ARCH, rank=rank, seed=lora_id))
    lin = model.layers[0].mlp.down_proj.lora  # K = 96
    g = torch.Generator().manual_seed(0)
    x, base = torch.randn(300, 96, generator=g).bfloat16(), torch.randn(300, 64, generator=g).bfloat16()

    def rows_out(lora_ids: list[int], lens: list[int], start: int) -> torch.Tensor:
        manager.set_batch(lora_ids, lens)
        n = sum(lens)
        return lin.apply(x[start : start + n], base[start : start + n].clone())

    alone = torch.cat([rows_out([7], [1], t) for t in range(300)])
    for lora_ids, lens in [([7, 0], [1, 1]), ([0, 7, 9], [3, 1, 2]), ([9, 7, 0, 7], [5, 1, 7, 2]),
                           ([7, 9], [40, 260]), ([9, 0, 7], [150, 1, 149]), ([0, 7], [1, 39])]:
        out = rows_out(lora_ids, lens, 0)
        t = 0
        for lora_id, n in zip(lora_ids, lens, strict=True):
            if lora_id == 7:
                assert torch.equal(out[t : t + n], alone[t : t + n]), (lora_ids, lens)
            elif lora_id == 0:
                assert torch.equal(out[t : t + n], base[t : t + n]), (lora_ids, lens)
            t += n
    a, b = manager_delta_weights(manager, 7)
    want = base.float() + (x.float() @ a.t().float()) @ b.t().float()
    torch.testing.assert_close(alone.float(), want, atol=0.1, rtol=0.02)


def manager_delta_weights(manager: LoRAManager, lora_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    lin = manager.layers[0].mlp.down_proj.lora
    slot, rank = manager.id_to_slot[lora_id], manager.slot_rank[manager.id_to_slot[lora_id]]
    return lin.a[slot, :rank], lin.b[slot, :, :rank]
