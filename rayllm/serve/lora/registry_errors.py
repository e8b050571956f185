"""The errors of a replica's LoRA registry (rayllm/serve/lora/lora_registry.py), as clients get them."""

from __future__ import annotations

import logging

from rayllm.loader import adapter_sources
from rayllm.loader.model_sources import ModelSourceError
from rayllm.protocol.errors import APIError
from rayllm.serve.lora.adapter_paths import refused

log = logging.getLogger("ray.serve")

# Whole seconds a client told lora_slots_busy is asked to wait (its Retry-After header).
SLOTS_RETRY_AFTER_S = 5


def invalid_adapter(message: str) -> APIError:
    return APIError(400, message, param="lora_path", code="invalid_lora_adapter")


def adapter_unavailable(name: str) -> APIError:
    """An adapter the server registered (cluster.yaml, the load route) that this replica cannot read: the
    request sent no path, so this is the server's problem, and another replica (or a retry) may serve it."""
    return APIError(503, f"LoRA adapter {name!r} is unavailable: the model replica serving this request cannot "
                    "read its files; retry later", type="server_error", code="lora_adapter_unavailable")


# The errors about an adapter's files (adapter_paths.refused, invalid_adapter, a remote source not found).
FILE_ERRORS = frozenset({"invalid_lora_adapter", "lora_adapter_not_found"})


def source_failure(name: str, exc: ModelSourceError) -> APIError:
    """A remote source that cannot be fetched: not there (404 naming it, as the client spelled it), or no
    adapter this server takes (the uniform 400 of adapter_paths; the reason goes to the log)."""
    if isinstance(exc, adapter_sources.NotAnAdapter):
        log.warning("LoRA adapter %r refused: %s", name, exc)
        return refused()
    return APIError(404, f"LoRA adapter {name!r}: {exc}", param="lora_path", code="lora_adapter_not_found")


class SlotsBusy(APIError):
    """503 lora_slots_busy with a Retry-After header, kept when Ray pickles it to the ingress."""

    def __init__(self, max_loras: int, waited_s: float) -> None:
        super().__init__(503, f"all {max_loras} LoRA adapter slots stayed in use by running requests for "
                         f"{waited_s:g} s; retry after the time given in the Retry-After header",
                         type="server_error", code="lora_slots_busy")
        self.max_loras, self.waited_s = max_loras, waited_s
        self.headers = {"Retry-After": str(SLOTS_RETRY_AFTER_S)}

    def __reduce__(self) -> tuple:
        return (SlotsBusy, (self.max_loras, self.waited_s))


def copy_removed(name: str) -> APIError:
    return APIError(503, f"LoRA adapter {name!r}: its copy on this node was removed before it was read; retry",
                    type="server_error", code="lora_adapter_unavailable")


def unloaded(name: str) -> APIError:
    return APIError(409, f"The lora adapter '{name}' was unloaded while this request ran.", type="conflict_error",
                    param="model", code="lora_adapter_unloaded")
