"""The ingress's table of LoRA adapters: which `model` names address an adapter, and where its files are.

Pure bookkeeping (no Ray, no I/O): the ingress asks it how to route a request; the adapters loaded at
runtime come from the app's store (rayllm/serve/lora/shared_adapters.py keeps them current), cluster.yaml's
from the configuration; the replicas hold the weights (rayllm/serve/lora/lora_registry.py).
"""

from __future__ import annotations

from rayllm.protocol.errors import APIError, model_not_found
from rayllm.protocol.responses import ModelCard
from rayllm.serve.lora.adapter_paths import resolve_allowed


class AdapterTable:
    def __init__(self, base_model: str, adapters: dict[str, str], created: int, allowed_roots: tuple[str, ...] = ()):
        self.base_model = base_model
        self.configured = dict(adapters)  # cluster.yaml's: configuration, never the load routes' to change
        self.paths: dict[str, str] = dict(adapters)  # name -> PEFT directory: configured, and loaded at runtime
        self.created = created
        self.allowed_roots = allowed_roots  # where clients may name directories (rayllm/serve/lora/adapter_paths.py)

    def allowed(self, path: str) -> str:
        """A client-named directory's canonical path, or the uniform 400 (see adapter_paths)."""
        return resolve_allowed(path, self.allowed_roots)

    def __contains__(self, name: str) -> bool:
        return name in self.paths

    def __iter__(self):
        return iter(self.paths)

    def name_of(self, model: str) -> str | None:
        """`base:adapter` -> adapter; a bare name other than the base's -> itself; the base -> None."""
        prefix = f"{self.base_model}:"
        if model.startswith(prefix):
            return model[len(prefix):]
        return None if model == self.base_model else model

    def card(self, name: str) -> dict:
        # `root` is the adapter's name, not its directory: clients learn nothing of the server's files.
        return ModelCard(id=name, created=self.created, root=name, parent=self.base_model).model_dump()

    def resolve(self, model: str | None, lora_path: str | list[str | None] | None) -> tuple[str | None, str | None]:
        """(adapter name, its path) for a request's `model` and `lora_path`, or (None, None) for the
        base model; 404 for an unknown adapter name, 400 for contradicting fields."""
        name = self.name_of(model) if model is not None else None
        if name is not None and name not in self.paths:
            raise model_not_found(model)
        if isinstance(lora_path, list):  # SGLang's per-prompt form: one adapter per request here
            distinct = set(lora_path)
            if len(distinct) > 1:
                raise APIError(400, "lora_path: all prompts of one request must use the same adapter",
                               param="lora_path")
            lora_path = distinct.pop() if distinct else None
        if lora_path is None:
            return (name, self.paths[name]) if name is not None else (None, None)
        if name is None:  # a registered adapter's name, or a directory loaded on demand (named by its path)
            if lora_path in self.paths:
                return lora_path, self.paths[lora_path]
            real = self.allowed(lora_path)
            return real, real
        if lora_path not in (name, self.paths[name]):
            raise APIError(400, f"model names adapter {name!r} but lora_path asks for {lora_path!r}",
                           param="lora_path")
        return name, self.paths[name]

    def set_runtime(self, adapters: dict[str, str]) -> None:
        """The adapters loaded at runtime (name -> path) as the store has them; a configured name keeps its
        configured path."""
        self.paths = adapters | self.configured

    def check_new(self, name: str | None) -> str:
        """A name the load route may register (vLLM's errors for a bad or taken name)."""
        if not name or ":" in name or name == self.base_model:
            raise APIError(400, f"invalid adapter name {name!r}", param="lora_name")
        if name in self.paths:
            raise adapter_exists(name)
        return name

    def check_unloadable(self, name: str) -> None:
        """An adapter configured in cluster.yaml is the configuration's: every ingress replica serves it
        from there, so no route can unload it (a 400 naming lora_name)."""
        if name in self.configured:
            raise APIError(400, f"LoRA adapter {name!r} is configured (lora.adapters in cluster.yaml), not loaded "
                           "at runtime: remove it from the configuration instead", param="lora_name",
                           code="lora_adapter_configured")


def adapter_exists(name: str) -> APIError:
    return APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                    code="lora_adapter_exists")


def adapter_not_found(name: str) -> APIError:
    return APIError(404, f"The lora adapter '{name}' cannot be found.", type="not_found_error", param="lora_name",
                    code="lora_adapter_not_found")
