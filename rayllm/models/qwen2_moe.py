"""Qwen2-MoE: q/k/v bias, softmax-then-top-k routing (renormalised only with `norm_topk_prob`), a
shared expert behind a sigmoid gate, and dense layers where `mlp_only_layers` / `decoder_sparse_step`
say so."""

from __future__ import annotations

from torch import nn

from rayllm.layers.basic import RotaryEmbedding
from rayllm.layers.linear import TPGroup
from rayllm.layers.moe import FusedMoE, MoEConfig, expert_param, sparse_layer_ids
from rayllm.models.llama import LlamaDecoderLayer
from rayllm.models.qwen2 import Qwen2ForCausalLM
from rayllm.schema.config import LlamaArch

_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}

# llama.cpp's names (gguf-py constants) -> Hugging Face's, for the routed and the shared experts.
MOE_GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    gguf_tensor_names = MOE_GGUF_NAMES
    qk_norm = False
    # Whether the top-k weights are renormalised when the checkpoint does not say (a GGUF carries no
    # norm_topk_prob; llama.cpp hard-codes it per architecture).
    renormalize_default = False

    @classmethod
    def moe_config(cls, arch: LlamaArch) -> MoEConfig:
        return MoEConfig.from_arch(arch, cls.renormalize_default)

    @staticmethod
    def windowed_layers(arch: LlamaArch, window: int) -> list[int | None]:
        """transformers' rule for Qwen2-MoE: every other layer, from the first, below max_window_layers."""
        first = int(arch.cfg("max_window_layers", 0))
        return [window if i % 2 == 0 and i < first else None for i in range(arch.num_layers)]

    def make_layer(self, index: int, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend) -> nn.Module:
        mlp = FusedMoE(arch, self.moe_config(arch), tp) if index in sparse_layer_ids(arch) else None
        return LlamaDecoderLayer(arch, tp, rotary, attn_backend, qk_norm=self.qk_norm, mlp=mlp)

    def checkpoint_to_param(self, name: str):
        return expert_param(name.removeprefix("model."), _PROJECTIONS) or super().checkpoint_to_param(name)
