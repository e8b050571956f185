"""Which class builds a model: a table of names, as the loader is. No torch at import time.

Keys are Hugging Face `model_type` values (config.json) and GGUF `general.architecture` values;
entries are "module:Class" so that only the family in use is imported.
"""

from __future__ import annotations

import importlib

from rayllm.schema.config import LlamaArch

# model_type / GGUF architecture -> "module:Class"
MODEL_CLASSES: dict[str, str] = {
    "llama": "rayllm.models.llama:LlamaForCausalLM",
    "mistral": "rayllm.models.llama:LlamaForCausalLM",
    "qwen2": "rayllm.models.qwen2:Qwen2ForCausalLM",
    "gemma2": "rayllm.models.gemma:GemmaForCausalLM",
    "gemma3_text": "rayllm.models.gemma:GemmaForCausalLM",
    # GGUF's name for Gemma 3 text; config.json's `gemma3` is the multimodal model, refused by the loader.
    "gemma3": "rayllm.models.gemma:GemmaForCausalLM",
    "phi3": "rayllm.models.phi3:Phi3ForCausalLM",
    "qwen3": "rayllm.models.qwen3:Qwen3ForCausalLM",
    "mixtral": "rayllm.models.mixtral:MixtralForCausalLM",  # GGUF: llama + expert_count (loader)
    "qwen2_moe": "rayllm.models.qwen2_moe:Qwen2MoeForCausalLM",
    "qwen2moe": "rayllm.models.qwen2_moe:Qwen2MoeForCausalLM",
    "qwen3_moe": "rayllm.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3moe": "rayllm.models.qwen3_moe:Qwen3MoeForCausalLM",
}


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture no family here implements; the message names both."""


def check_supported(model_type: str | None, where: str) -> str:
    if model_type not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"unsupported model architecture {model_type!r} in {where}; supported: {', '.join(sorted(MODEL_CLASSES))}")
    return model_type  # type: ignore[return-value]


def model_class(arch: LlamaArch) -> type:
    module, _, name = MODEL_CLASSES[check_supported(arch.model_type, "the model config")].partition(":")
    return getattr(importlib.import_module(module), name)


def kv_window(arch: LlamaArch) -> int | None:
    """How many of its latest positions a sequence's KV cache must keep, when every layer attends
    within a sliding window (the widest of them); None when some layer attends to the whole context.
    Only then can blocks behind the window be freed: a single global layer (Gemma 2/3 interleave
    them) reads every position from the same blocks as the windowed ones."""
    windows = model_class(arch).layer_windows(arch)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
