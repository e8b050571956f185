"""Qwen3-MoE: Qwen2-MoE's experts without the shared one, and Qwen3's per-head q/k RMSNorm, no bias."""

from __future__ import annotations

from rayllm.models.qwen2_moe import MOE_GGUF_NAMES, Qwen2MoeForCausalLM
from rayllm.models.qwen3 import QK_NORM_GGUF_NAMES
from rayllm.schema.config import LlamaArch


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    gguf_tensor_names = MOE_GGUF_NAMES | QK_NORM_GGUF_NAMES
    qk_norm = True
    renormalize_default = True

    @staticmethod
    def windowed_layers(arch: LlamaArch, window: int) -> list[int | None]:
        return [window] * arch.num_layers
