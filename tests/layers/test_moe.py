"""The MoE layer's pieces against references: routing against transformers' own routers, the
grouped expert computation against a plain per-token loop, sparse-layer choice against transformers'
Qwen MoE decoder layers. Weights and inputs are random."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayllm.layers.moe import expert_param, fused_experts, route, sparse_layer_ids
from rayllm.models.registry import model_class
from rayllm.schema.config import LlamaArch


def per_token_reference(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens,top_k", [(1, 1), (7, 2), (33, 3)])
def test_grouped_experts_equal_a_per_token_loop(tokens, top_k):
    g = torch.Generator().manual_seed(tokens)
    e, h, i = 8, 16, 12
    x = torch.randn(tokens, h, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * i, h, generator=g, dtype=torch.float64)
    w2 = torch.randn(e, h, i, generator=g, dtype=torch.float64)
    weights, ids = route(torch.randn(tokens, e, generator=g), top_k, renormalize=False)
    got = fused_experts(x, w13, w2, weights.double(), ids)
    torch.testing.assert_close(got, per_token_reference(x, w13, w2, weights, ids))
    if tokens * top_k < e:  # some experts have no token this step: skipped, not run on an empty batch
        assert len(set(ids.flatten().tolist())) < e


def _router(model_type: str, **kw):
    from transformers import AutoConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter}[model_type]
    router = cls(AutoConfig.for_model(model_type, hidden_size=16, num_experts_per_tok=2, **kw))
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
    return router


@pytest.mark.parametrize("model_type,kw", [
    ("mixtral", {"num_local_experts": 8}),
    ("qwen2_moe", {"num_experts": 8, "norm_topk_prob": False}),
    ("qwen3_moe", {"num_experts": 8, "norm_topk_prob": True}),
])
def test_routing_matches_transformers_routers(model_type, kw):
    router = _router(model_type, **kw)
    arch = LlamaArch(16, 32, 1, 4, 4, 4, 64, 1e-6, 1e4, 64, False, model_type=model_type,
                     hf_config=tuple(sorted((kw | {"num_experts_per_tok": 2}).items())))
    cfg = model_class(arch).moe_config(arch)  # the family's rule where the config does not say
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(1))
    _, ref_weights, ref_ids = router(x)
    weights, ids = route(F.linear(x, router.weight), cfg.top_k, cfg.renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights.float())
    assert cfg.renormalize == (model_type != "qwen2_moe")


@pytest.mark.parametrize("kw", [{}, {"mlp_only_layers": [0, 3]}, {"decoder_sparse_step": 2},
                                {"decoder_sparse_step": 2, "mlp_only_layers": [1]}])
def test_sparse_layers_are_the_ones_transformers_builds(kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2_moe", hidden_size=16, intermediate_size=16, num_hidden_layers=4,
                               num_attention_heads=2, num_key_value_heads=2, vocab_size=32, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    expected = {i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    arch = LlamaArch(16, 16, 4, 2, 2, 8, 32, 1e-6, 1e4, 64, False, model_type="qwen2_moe",
                     hf_config=tuple(sorted(cfg.to_dict().items())))
    assert sparse_layer_ids(arch) == expected


def test_expert_tensor_names_map_to_stacked_parameters():
    qwen = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}
    assert expert_param("layers.3.mlp.experts.5.up_proj.weight", qwen) == ("layers.3.mlp.w13", (5, 1))
    assert expert_param("layers.3.mlp.experts.down_proj.weight", qwen) == ("layers.3.mlp.w2", (None, 2))  # GGUF
    assert expert_param("layers.3.mlp.shared_expert.up_proj.weight", qwen) is None
    assert expert_param("layers.0.mlp.experts.1.w3.weight", {"w1": 0, "w3": 1, "w2": 2}) == ("layers.0.mlp.w13", (1, 1))
