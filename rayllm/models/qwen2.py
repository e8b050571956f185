"""Qwen2: the Llama decoder with q/k/v bias (read by the loader) and Qwen's sliding-window rule: windows only
with `use_sliding_window`, on the layers from `max_window_layers` on (older configs without `layer_types`)."""

from __future__ import annotations

from rayllm.models.llama import LlamaForCausalLM
from rayllm.schema.config import LlamaArch


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def uses_sliding_window(arch: LlamaArch) -> bool:
        return bool(arch.cfg("use_sliding_window"))

    @staticmethod
    def windowed_layers(arch: LlamaArch, window: int) -> list[int | None]:
        first = int(arch.cfg("max_window_layers", 0))
        return [window if i >= first else None for i in range(arch.num_layers)]
