"""The ingress's model table: which base model a request's `model` names (its name, an alias, or
`name:adapter`), that model's deployment handle, tokenizer, adapters and model cards.

The ingress handles each request in its own asyncio task; `ModelRoutes.select` records the chosen model in
a context variable of that task, so the handler's helpers (`Ingress.llm`, `.tokenizer`, `.info()`, ...)
reach that model without every call passing it along. Requests that name no model get the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from ray.serve.handle import DeploymentHandle

from rayllm.protocol.errors import APIError, model_not_found
from rayllm.protocol.io_struct import ModelInfo
from rayllm.protocol.responses import ModelCard
from rayllm.serve.config import ModelEntry
from rayllm.serve.lora.adapter_table import AdapterTable
from rayllm.serve.render_batcher import RenderBatcher
from rayllm.serve.request_guards import Overloaded, call_model, cancel
from rayllm.serve.stores.adapter_store import StoredAdapter

# Clients poll /v1/models for readiness: a model card waits at most this long for its replica's context
# length (a full queue, a busy replica) before it shows the configured one.
CARD_INFO_WAIT_S = 2.0


class _TokenizerCall:
    def __init__(self, handle: DeploymentHandle, method: str, model: str):
        self.handle, self.method, self.model = handle, method, model

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.handle, self.method).remote(self.model, *args, **kwargs)


class ModelTokenizer:
    """The shared tokenizer deployment bound to one model: `.encode.remote(text)` names the model for you."""

    def __init__(self, handle: DeploymentHandle, model: str):
        self.handle, self.model = handle, model

    def __getattr__(self, method: str) -> _TokenizerCall:
        return _TokenizerCall(self.handle, method, self.model)


class RouteAdapters(AdapterTable):
    """One model's adapters; `alias:adapter` addresses them as `name:adapter` does."""

    def __init__(self, base_model: str, aliases: tuple[str, ...], adapters: dict[str, str], created: int,
                 allowed_roots: tuple[str, ...] = ()):
        super().__init__(base_model, adapters, created, allowed_roots)
        self.aliases = aliases

    def name_of(self, model: str) -> str | None:
        for base in (self.base_model, *self.aliases):
            if model == base:
                return None
            if model.startswith(f"{base}:"):
                return model[len(base) + 1:]
        return model


class ModelRoute:
    """One base model as the ingress sees it."""

    def __init__(self, entry: ModelEntry, llm: DeploymentHandle, tokenizer: DeploymentHandle, created: int):
        self.name = entry.name
        self.aliases = entry.aliases
        self.llm = llm
        self.tokenizer = ModelTokenizer(tokenizer, entry.name)
        self.renderer = RenderBatcher(self.tokenizer)
        self.created = created
        lora = entry.engine.lora
        self.lora_enabled = lora.enabled
        self.adapters = RouteAdapters(entry.name, entry.aliases, dict(lora.adapters), created, lora.allowed_roots)
        self.configured_max_model_len = entry.engine.model.max_model_len
        self._info: ModelInfo | None = None
        self._tok_info: dict | None = None

    def llm_for(self, adapter: str | None) -> DeploymentHandle:
        """Adapter calls carry Serve's multiplexed model id, so they go to replicas holding the adapter;
        base-model calls carry none and spread over every replica."""
        return self.llm if adapter is None else self.llm.options(multiplexed_model_id=adapter)

    async def info(self) -> ModelInfo:
        if self._info is None:
            self._info = await self.llm.model_info.remote()
        return self._info

    async def tokenizer_info(self) -> dict:
        if self._tok_info is None:
            self._tok_info = await self.tokenizer.info.remote()
        return self._tok_info

    async def card(self, model_id: str | None = None, idle: bool = False) -> dict:
        """The model's card; an alias's card has the alias as id and the model as root."""
        return self.card_with(await self.card_max_model_len(idle), model_id)

    def card_with(self, max_model_len: int | None, model_id: str | None = None) -> dict:
        return ModelCard(id=model_id or self.name, created=self.created, root=self.name,
                         max_model_len=max_model_len).model_dump()

    async def card_max_model_len(self, idle: bool) -> int | None:
        """The replica's context length, once it has answered. An `idle` model (no running replica: scaled to
        zero, starting, failed) is not called: the call would wake it, or wait for a replica that may never
        come. Nor is one waited for past CARD_INFO_WAIT_S. Either shows the configured length meanwhile; a
        replica that died under the call is a 503 (model_replica_failed)."""
        if self._info is None and not idle:
            call = self.llm.model_info.remote()
            try:
                async with asyncio.timeout(CARD_INFO_WAIT_S):
                    self._info = await call_model(call, retry_after_s=0)
            except (TimeoutError, Overloaded):  # a busy model: the card does not wait for it
                cancel(call)  # not left queued for a replica: the next listing asks again
        return self.configured_max_model_len if self._info is None else self._info["max_model_len"]


_current: ContextVar[ModelRoute | None] = ContextVar("rayllm_model_route", default=None)


class ModelRoutes:
    def __init__(self, models: tuple[ModelEntry, ...], llms: dict[str, DeploymentHandle],
                 tokenizer: DeploymentHandle, created: int):
        self.routes = [ModelRoute(m, llms[m.name], tokenizer, created) for m in models]
        self.by_name = {n: r for r in self.routes for n in (r.name, *r.aliases)}
        self.lora_enabled = any(r.lora_enabled for r in self.routes)
        for route in self.routes:  # cluster.yaml's adapters: a clash is the operator's to fix before serving
            for name in route.adapters:
                clash = self.clash(name, route)
                if clash is not None:
                    raise ValueError(f"model {route.name!r}: lora.adapters name {name!r} cannot be used: {clash}")

    def __iter__(self) -> Iterator[ModelRoute]:
        return iter(self.routes)

    @property
    def current(self) -> ModelRoute:
        """The model this request selected; the first model before (or without) a selection."""
        return _current.get() or self.routes[0]

    def find(self, model: str | None) -> ModelRoute:
        """The base model `model` addresses (name, alias, `name:adapter`, or an adapter's own name), or a 404
        naming the models there are."""
        if model is None:
            return self.routes[0]
        route = self.by_name.get(model) or self.by_name.get(model.split(":", 1)[0])
        if route is None:
            route = next((r for r in self.routes if model in r.adapters), None)
        if route is None:
            raise self.unknown(model)
        return route

    def base(self, model: str | None) -> ModelRoute:
        """The base model a LoRA admin body's `model` names (its name or an alias; None: the first), or a 404."""
        if model is None:
            return self.routes[0]
        route = self.by_name.get(model)
        if route is None:
            raise self.unknown(model)
        return route

    def holding(self, adapter: str) -> ModelRoute:
        """The model whose table holds `adapter` (names are unique across models); the first if none does."""
        return next((r for r in self.routes if adapter in r.adapters), self.routes[0])

    def configured(self, adapter: str) -> bool:
        return any(adapter in r.adapters.configured for r in self.routes)

    def runtime_names(self, model: str | None, lora_path: str | list[str | None] | None = None) -> list[str]:
        """The names a request's `model` and `lora_path` may give an adapter loaded at runtime: not a model's
        name or alias, nor a cluster.yaml adapter's (those are known without the store)."""
        names = []
        if model is not None and model not in self.by_name:
            base, colon, adapter = model.partition(":")
            if not colon:
                names.append(model)
            elif base in self.by_name:
                names.append(adapter)
        # A lora_path may name a registered adapter instead of a directory (AdapterTable.resolve).
        names += [p for p in (lora_path if isinstance(lora_path, list) else [lora_path]) if isinstance(p, str)]
        return [n for n in names if not self.configured(n)]

    def apply(self, adapters: Iterable[StoredAdapter]) -> None:
        """Each model's adapters loaded at runtime, as the store has them. A row whose model this app does not
        serve with LoRA (its configuration changed since the load), or whose name a model or cluster.yaml
        has taken meanwhile, is left out: the configuration wins."""
        by_model: dict[str, dict[str, str]] = {r.name: {} for r in self.routes if r.lora_enabled}
        for a in adapters:
            if a.model in by_model and a.name not in self.by_name and not self.configured(a.name):
                by_model[a.model][a.name] = a.path
        for route in self.routes:
            route.adapters.set_runtime(by_model.get(route.name, {}))

    def clash(self, adapter: str, route: ModelRoute) -> str | None:
        """Why `adapter` cannot be `route`'s adapter, if it cannot: requests address adapters by their bare
        name, which must therefore reach nothing else (find() would pick a model, or the other model's adapter)."""
        owner = self.by_name.get(adapter)
        if owner is not None:
            return f"it is {'the name' if adapter == owner.name else 'an alias'} of model {owner.name!r}"
        other = next((r for r in self.routes if r is not route and adapter in r.adapters), None)
        if other is not None:
            return f"model {other.name!r} has an adapter of that name (adapter names are unique across models)"
        return None

    def check_new_adapter(self, route: ModelRoute, name: str) -> str:
        """A name the load route may register for `route` (400 naming lora_name otherwise)."""
        name = route.adapters.check_new(name)
        clash = self.clash(name, route)
        if clash is not None:
            taken = name not in self.by_name  # another model's adapter: vLLM's code for a name already loaded
            raise APIError(400, f"invalid adapter name {name!r}: {clash}", param="lora_name",
                           code="lora_adapter_exists" if taken else None)
        return name

    def unknown(self, model: str) -> APIError:
        return model_not_found(model, sorted(self.by_name))

    def select(self, model: str | None) -> ModelRoute:
        """Find the model and make it this request's (see the module docstring)."""
        route = self.find(model)
        _current.set(route)
        return route

    async def cards(self, idle: frozenset[str] = frozenset()) -> list[dict]:
        """Every model, then every alias, then every adapter (its parent is its base model); the models
        named in `idle` (no running replica) are listed without a call to them, the others' lengths asked
        for together (each wait bounded: ModelRoute.card_max_model_len)."""
        lengths = await asyncio.gather(*(r.card_max_model_len(r.name in idle) for r in self.routes))
        cards = [r.card_with(n) for r, n in zip(self.routes, lengths, strict=True)]
        cards += [r.card_with(n, alias) for r, n in zip(self.routes, lengths, strict=True) for alias in r.aliases]
        return cards + [r.adapters.card(n) for r in self.routes for n in r.adapters]
