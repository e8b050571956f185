"""Mixtral: the Llama (Mistral) decoder with a sparse mixture of experts in every layer; top-k
weights are a softmax over the chosen experts' logits. GGUF: llama.cpp writes it as architecture
`llama` with `llama.expert_count` (the loader names it mixtral), experts stacked per layer."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from rayllm.layers.basic import RotaryEmbedding
from rayllm.layers.linear import TPGroup
from rayllm.layers.moe import FusedMoE, MoEConfig, expert_param
from rayllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from rayllm.schema.config import LlamaArch

_PROJECTIONS = {"w1": 0, "w3": 1, "w2": 2}  # gate, up, down


class MixtralForCausalLM(LlamaForCausalLM):
    gguf_tensor_names = {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.w1",
        "ffn_up_exps": "mlp.experts.w3",
        "ffn_down_exps": "mlp.experts.w2",
    }

    @staticmethod
    def moe_config(arch: LlamaArch) -> MoEConfig:
        """Mixtral always renormalises: a softmax over the chosen experts' logits."""
        return replace(MoEConfig.from_arch(arch), renormalize=True)

    def make_layer(self, index: int, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend) -> nn.Module:
        return LlamaDecoderLayer(arch, tp, rotary, attn_backend, mlp=FusedMoE(arch, self.moe_config(arch), tp))

    def checkpoint_to_param(self, name: str):
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return expert_param(name.removeprefix("model."), _PROJECTIONS) or super().checkpoint_to_param(name)
