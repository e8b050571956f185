"""Qwen3-MoE: Qwen2-MoE's experts without the shared one, and Qwen3's per-head q/k RMSNorm, no bias."""

from __future__ import annotations

from rayllm.models.qwen2_moe import MOE_GGUF_NAMES, Qwen2MoeForCausalLM
from rayllm.models.qwen3 import QK_NORM_GGUF_NAMES


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    gguf_tensor_names = MOE_GGUF_NAMES | QK_NORM_GGUF_NAMES
    qk_norm = True
