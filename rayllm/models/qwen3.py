"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before rotary, no qkv bias, and an
explicit head_dim (read by the loader); windows as Qwen2."""

from __future__ import annotations

from torch import nn

from rayllm.layers.basic import RotaryEmbedding
from rayllm.layers.linear import TPGroup
from rayllm.models.llama import LlamaDecoderLayer
from rayllm.models.qwen2 import Qwen2ForCausalLM
from rayllm.schema.config import LlamaArch

QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    gguf_tensor_names = QK_NORM_GGUF_NAMES

    def make_layer(self, index: int, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend) -> nn.Module:
        return LlamaDecoderLayer(arch, tp, rotary, attn_backend, qk_norm=True)
