"""The app's LoRA adapters loaded at runtime, as one ingress replica sees them, and the load and unload
steps that change them for every replica.

The adapters live in the app's store (rayllm/serve/stores/adapter_store.py: the conversations' database),
so every ingress replica serves the same ones and a restarted replica finds them again. Each replica keeps
the rows it last read (in its ModelRoutes' tables); reads run off the event loop. How stale a replica may be:

- a name it does not know is looked up in the store at once (a read that starts after the request came), so
  an adapter is served by every replica as soon as its load has answered; a name that read did not find is
  not read for again while the view is FRESH_S old (unknown names cost one read per FRESH_S, however many
  requests name them), and requests of unknown names at once share one read;
- a name it knows is read again once its view is FRESH_S old, so an unload (or a load of the name from other
  files) made through another replica reaches this one within FRESH_S seconds;
- /v1/models and the load route read the store every time; base-model requests never read it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from rayllm.protocol.errors import APIError
from rayllm.serve.lora.adapter_table import adapter_exists, adapter_not_found
from rayllm.serve.stores.adapter_store import AdapterStore, StoredAdapter

if TYPE_CHECKING:
    from rayllm.serve.routes.model_routes import ModelRoute, ModelRoutes

log = logging.getLogger("ray.serve")

# Seconds a replica serves a known adapter name from its last read of the store (see the module docstring).
FRESH_S = 2.0
MAX_MISSING = 10_000  # unknown names a view remembers (SharedAdapters.missing)


def unloaded_while_loading(name: str) -> APIError:
    return APIError(409, f"The lora adapter '{name}' was unloaded while it loaded.", type="conflict_error",
                    param="lora_name", code="lora_adapter_unloaded")


class SharedAdapters:
    def __init__(self, store: AdapterStore, routes: ModelRoutes, fresh_s: float = FRESH_S) -> None:
        self.store = store
        self.routes = routes
        self.fresh_s = fresh_s
        self.adapters: dict[str, StoredAdapter] = {}  # the view: the store's rows, and this replica's own changes
        self.read_at = -math.inf  # monotonic start of the read the view comes from
        self.changed_at = -math.inf  # this replica's last own change
        self._shared: asyncio.Task | None = None  # the read in flight, that requests wait on together
        self._shared_at = -math.inf  # its monotonic start (inf until it starts)
        self.missing: dict[str, float] = {}  # name -> start of the last read that did not find it

    async def read(self) -> None:
        """The store's rows now: whatever was committed before this call is in the view after it."""
        if not self.routes.lora_enabled:
            return  # no model takes adapters: no request resolves one, and the store is never read
        started = time.monotonic()
        rows = await asyncio.to_thread(self.store.adapters)
        # Reads overlap: one that started before the view's read, or before an own change, is older than both.
        if started >= max(self.read_at, self.changed_at):
            self.adapters = {a.name: a for a in rows}
            self.read_at = started
            self.routes.apply(self.adapters.values())

    async def lookup(self, model: str | None, lora_path: str | list[str | None] | None = None) -> None:
        """Brings the view up to date for a request's `model` and `lora_path` (the bound is the module
        docstring's); 503 storage_unavailable when the store cannot be read."""
        names = self.routes.runtime_names(model, lora_path)
        if not names:
            return
        now = time.monotonic()
        unknown = [n for n in names if n not in self.adapters]
        if any(now - self.missing.get(n, -math.inf) >= self.fresh_s for n in unknown):
            await self._read_since(now)
            self._missed([n for n in unknown if n not in self.adapters], now)
        elif now - self.read_at >= self.fresh_s:
            await self._read_since(None)  # a stale view: any read in flight will do

    def _missed(self, names: list[str], at: float) -> None:
        if len(self.missing) + len(names) > MAX_MISSING:  # a flood of made-up names: forget the old ones
            self.missing = {n: t for n, t in self.missing.items() if at - t < self.fresh_s}
            if len(self.missing) + len(names) > MAX_MISSING:
                self.missing = {}
        self.missing.update(dict.fromkeys(names, at))

    async def _timed_read(self) -> None:
        self._shared_at = time.monotonic()  # requests that came before this may not join it
        await self.read()

    async def _read_since(self, since: float | None) -> None:
        """Waits for a read of the store, shared by every request that waits meanwhile: the one in flight if
        it started at `since` or later (None: whenever), else a new one (after the one in flight ends)."""
        while True:
            task = self._shared
            if task is None or task.done():
                task = self._shared = asyncio.create_task(self._timed_read())
                self._shared_at = math.inf  # not started: any request may join it
                # Its error reaches every waiter; this keeps one whose waiters all left from being logged.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                break
            if since is None or self._shared_at >= since:
                break
            await asyncio.wait([task])  # an earlier read: not this request's, nor are its errors
        await asyncio.shield(task)

    def _changed(self, name: str, adapter: StoredAdapter | None) -> None:
        """This replica's own load or unload: in its view at once (no read needed)."""
        self.changed_at = time.monotonic()
        if adapter is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = adapter
        self.routes.apply(self.adapters.values())

    async def load(self, route: ModelRoute, name: str, path: str) -> dict:
        """Reserves `name` in the store (vLLM's 400 lora_adapter_exists when taken: of two loads of one name
        at once, through any replicas, one wins), has one of the model's replicas load and check the files,
        then makes the adapter one that requests resolve. A refused load gives its reservation up.
        Returns the replica's card of the adapter."""
        token = await asyncio.to_thread(self.store.reserve, route.name, name, path)
        if token is None:
            raise adapter_exists(name)
        try:
            # A model replica may still hold the name from before (loaded in an ingress replica's stale
            # window after an unload, or missed by that unload): it would answer from memory, maybe old files.
            await self._unload_everywhere(route, name)
            card = await route.llm_for(name).load_lora_adapter.remote(name, path)
            confirmed = await asyncio.to_thread(self.store.confirm, name, token)
        except BaseException:  # refused, failed or cancelled: the name is free again
            await self._release(name, token)
            raise
        if not confirmed:  # an unload of the name came between: it wins, so the replicas drop the files too
            await self._unload_everywhere(route, name)
            raise unloaded_while_loading(name)
        self._changed(name, StoredAdapter(name, route.name, path, int(time.time())))
        return card

    async def _release(self, name: str, token: str) -> None:
        try:
            await asyncio.to_thread(self.store.release, name, token)
        except Exception as exc:  # the load's own error matters more; the reservation waits for an unload
            log.warning("LoRA adapter %r: its failed load's reservation could not be given up (%s); "
                        "unloading the name frees it", name, exc)

    async def unload(self, route: ModelRoute, name: str) -> None:
        """Removes `route`'s adapter `name` for every replica (404 when it has none; 400 for a cluster.yaml
        adapter), then has every model replica that holds it abort its requests and free the slot."""
        route.adapters.check_unloadable(name)
        if not await asyncio.to_thread(self.store.remove, route.name, name):
            raise adapter_not_found(name)
        self._changed(name, None)
        await self._unload_everywhere(route, name)

    @staticmethod
    async def _unload_everywhere(route: ModelRoute, name: str) -> None:
        """Every running model replica of `route` drops `name` (a no-op where it is not resident), each
        answering once its slot is free. A call routed by the adapter's multiplexed id reaches one replica,
        and Serve may have sent the adapter's requests to several."""
        try:
            answers = await route.llm.broadcast("unload_lora_adapter", name).results_async(return_exceptions=True)
        except DeploymentUnavailableError:  # no replica known to this handle (yet): Serve routes one call
            await route.llm_for(name).unload_lora_adapter.remote(name)
            return
        # A replica that died took its adapters with it; any other failure is the caller's.
        failed = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, RayActorError)]
        if failed:
            raise failed[0]
