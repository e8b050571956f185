"""vLLM's LoRA admin bodies: POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

from pydantic import Field

from rayllm.protocol.messages import Strict


class LoadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)  # a PEFT adapter directory on the server's filesystem
    # Our extension for several base models: the base model's name or alias (default: the first model).
    model: str | None = Field(None, min_length=1, max_length=256)


class UnloadLoRAAdapterRequest(Strict):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's optional field; accepted and ignored
    # The base model's name or alias; default: whichever model holds the adapter (names are unique).
    model: str | None = Field(None, min_length=1, max_length=256)
