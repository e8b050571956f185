"""A test-only attention backend and a test-only model family, each registered with one table line by the
tests (attention/registry.BACKENDS, models/registry.MODEL_CLASSES): what adding either takes."""

from __future__ import annotations

from rayllm.attention.sdpa import SDPAAttention
from rayllm.models.llama import LlamaForCausalLM


class CountingAttention(SDPAAttention):
    """Torch SDPA that counts its calls: the engine's results must not change, and the calls must be its."""

    name = "counting"
    calls = 0

    def __call__(self, *args, **kwargs):
        type(self).calls += 1
        return super().__call__(*args, **kwargs)


class TinyTestFamily(LlamaForCausalLM):
    """A family that is Llama under another model_type: built through the registry like any other."""

    built = 0

    def __init__(self, *args, **kwargs) -> None:
        type(self).built += 1
        super().__init__(*args, **kwargs)
