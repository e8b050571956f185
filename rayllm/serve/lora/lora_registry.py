"""Per-replica LoRA adapter registry: name -> slot, LRU eviction of idle adapters, loads on every TP rank.

The registry is the source of truth for what a replica holds. Ray Serve's multiplexing (see
`LLMServer`) only learns from it which adapter names this replica has, so that the router sends
adapter requests to replicas that already hold the adapter.

Each load gets a fresh integer id (never reused). Sequences carry that id as their `lora_slot`, so a
slot refilled with another adapter can never match prefix-cache blocks computed with the old one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayllm.loader import model_sources
from rayllm.lora.files import LoRAError, read_peft_adapter
from rayllm.protocol.errors import APIError
from rayllm.schema.config import LoRAConfig
from rayllm.serve.lora.adapter_paths import remote_source, resolve_allowed

if TYPE_CHECKING:
    from rayllm.engine.client.engine_client import EngineClient

log = logging.getLogger("ray.serve")


@dataclass
class AdapterEntry:
    name: str
    path: str
    lora_id: int  # what sequences carry; unique per load
    slot: int  # 1..max_loras
    rank: int
    active: int = 0  # requests in flight
    unloading: bool = False  # unload asked: its requests are being aborted, the slot is freed after them
    loaded_at: float = field(default_factory=time.time)
    # Queues of the requests in flight: an unload pushes an error into each (they end, aborting their sequences).
    holders: set[asyncio.Queue] = field(default_factory=set)
    dropped: asyncio.Future | None = None  # set once the slot is free (unload waits on it)

    def card(self) -> dict:
        return {"name": self.name, "path": self.path, "slot": self.slot, "rank": self.rank, "active": self.active}


def invalid_adapter(message: str) -> APIError:
    return APIError(400, message, param="lora_path", code="invalid_lora_adapter")


def adapter_unavailable(name: str) -> APIError:
    """An adapter the server registered (cluster.yaml, the load route) that this replica cannot read: the
    request sent no path, so this is the server's problem, and another replica (or a retry) may serve it."""
    return APIError(503, f"LoRA adapter {name!r} is unavailable: the model replica serving this request cannot "
                    "read its files; retry later", type="server_error", code="lora_adapter_unavailable")


# The errors about an adapter's files (adapter_paths.refused, invalid_adapter, a remote source not found).
_FILE_ERRORS = frozenset({"invalid_lora_adapter", "lora_adapter_not_found"})


def unloaded(name: str) -> APIError:
    return APIError(409, f"The lora adapter '{name}' was unloaded while this request ran.", type="conflict_error",
                    param="model", code="lora_adapter_unloaded")


class LoRARegistry:
    """Adapters resident on one replica, loaded through its engine client.

    A slot is freed (or refilled) only once the engine holds no sequence of the adapter it held: a
    request counts as active until every one of its sequences has ended and its abort was submitted
    (release() after the choices' tasks are done). The engine client runs commands in the order they
    were made, so the unload (or the load that refills the slot) reaches the engine after those aborts.
    """

    def __init__(self, config: LoRAConfig, engine: EngineClient, on_evict: Callable[[str], None] | None = None):
        self.config = config
        self.engine = engine
        self.on_evict = on_evict  # tells Serve's multiplexing cache that the name is gone
        self.entries: OrderedDict[str, AdapterEntry] = OrderedDict()  # least recently used first
        # the operator's: no root needed (a remote source as written, a local one canonical)
        self.trusted = {p if remote_source(p) else os.path.realpath(p) for _, p in config.adapters}
        self._fetched: dict[str, str] = {}  # remote source -> this node's copy
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load at a time: slot choice and weight copies do not interleave

    def names(self) -> list[str]:
        return [n for n, e in self.entries.items() if not e.unloading]

    def check_path(self, path: str) -> str:
        """The canonical path of an adapter a client named; the uniform 400 outside lora.allowed_roots."""
        real = path if remote_source(path) else os.path.realpath(path)
        return real if real in self.trusted else resolve_allowed(path, self.config.allowed_roots)

    def _local(self, name: str, path: str) -> str:
        """A remote source's copy in this node's cache (fetched once); a local path as it is."""
        if not remote_source(path):
            return path
        if path not in self._fetched:
            try:
                self._fetched[path] = model_sources.fetch(path.removeprefix("hf://")).path
            except model_sources.ModelSourceError as exc:
                raise APIError(404, f"LoRA adapter {name!r}: {exc}", param="lora_path",
                               code="lora_adapter_not_found") from None
        return self._fetched[path]

    def _take_slot(self) -> int | None:
        """A free slot, evicting the least recently used idle adapter if none is."""
        used = {e.slot for e in self.entries.values()}
        for slot in range(1, self.config.max_loras + 1):
            if slot not in used:
                return slot
        for name, entry in self.entries.items():
            if entry.active == 0 and not entry.unloading:
                del self.entries[name]
                log.info("LoRA adapter %r evicted (least recently used) from slot %d", name, entry.slot)
                if self.on_evict is not None:
                    self.on_evict(name)
                return entry.slot
        return None

    def _validate(self, name: str, path: str) -> int:
        """Read and check the files here first (clear errors, and nothing is evicted for a bad adapter)."""
        try:
            return read_peft_adapter(self._local(name, path), self.engine.arch, self.config.max_lora_rank).rank
        except LoRAError as exc:
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None

    def _write(self, name: str, path: str, slot: int, rank: int) -> AdapterEntry:
        """Every TP rank reads its own shard of the files into `slot`."""
        lora_id = self._next_id
        self._next_id += 1
        try:
            self.engine.load_lora(slot, lora_id, self._local(name, path))
        except LoRAError as exc:  # the files changed since _validate
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None
        return AdapterEntry(name, path, lora_id, slot, rank)

    def load_now(self, name: str, path: str) -> AdapterEntry:
        """Synchronous load at replica start (adapters named in cluster.yaml); errors fail the replica."""
        path = self.check_path(path)  # canonical, as requests' paths are checked against it (_resident)
        rank = self._validate(name, path)
        slot = self._take_slot()
        if slot is None:
            raise ValueError(f"no free LoRA slot for {name!r} (lora.max_loras={self.config.max_loras})")
        entry = self._write(name, path, slot, rank)
        self.entries[name] = entry
        return entry

    def _resident(self, name: str, path: str) -> AdapterEntry | None:
        entry = self.entries.get(name)
        if entry is not None and entry.path == path and not entry.unloading:
            self.entries.move_to_end(name)
            return entry
        return None

    async def load(self, name: str, path: str, client_path: bool = True) -> AdapterEntry:
        """Make `name` resident (from `path`); a no-op when it already is, from the same path (whatever
        the files are now: its weights are in memory). `client_path`: the request itself named `path` (the
        load route, a request's lora_path), so a file problem is its 400 on lora_path; else the server
        registered the adapter and cannot read it here: a 503 naming the adapter (details in the log)."""
        entry = self._resident(name, path if remote_source(path) else os.path.realpath(path))
        if entry is not None:
            return entry
        try:
            return await self._load(name, self.check_path(path))
        except APIError as exc:
            if client_path or exc.code not in _FILE_ERRORS:
                raise
            log.warning("registered LoRA adapter %r (%s) cannot be loaded on this replica: %s", name, path,
                        exc.message)
            raise adapter_unavailable(name) from None

    async def _load(self, name: str, path: str) -> AdapterEntry:
        async with self._lock:
            entry = self._resident(name, path)
            if entry is not None:
                return entry
            old = self.entries.get(name)
            if old is not None and old.unloading and old.dropped is not None:
                await asyncio.shield(old.dropped)  # an unload of the same name is finishing
                old = None
            rank = await asyncio.to_thread(self._validate, name, path)
            if old is not None:  # same name, new files
                if old.active:
                    raise APIError(409, f"LoRA adapter {name!r} is in use with other files; retry later",
                                   type="conflict_error", param="lora_path")
                del self.entries[name]
                slot: int | None = old.slot
            else:
                slot = self._take_slot()
            if slot is None:
                raise APIError(503, f"all {self.config.max_loras} LoRA adapter slots are in use by running "
                               "requests; retry later", type="server_error", code="lora_slots_busy")
            new = await asyncio.to_thread(self._write, name, path, slot, rank)
            self.entries[name] = new
            log.info("LoRA adapter %r (rank %d) loaded into slot %d", name, new.rank, slot)
            return new

    async def acquire(self, name: str, path: str, queue: asyncio.Queue | None = None) -> AdapterEntry:
        """Load if needed and count one request in flight; pair with release(). An unload pushes an
        error into `queue` (the request's output queue), which ends the request."""
        # A request names a directory itself only in lora_path's on-demand form, which names the adapter
        # by its path (AdapterTable.resolve); any other adapter is one the server registered.
        entry = await self.load(name, path, client_path=name == path)
        entry.active += 1
        if queue is not None:
            entry.holders.add(queue)
        return entry

    def release(self, entry: AdapterEntry, queue: asyncio.Queue | None = None) -> None:
        """Call once every sequence of the request has ended (its abort submitted to the engine)."""
        entry.active -= 1
        entry.holders.discard(queue)  # type: ignore[arg-type]
        if entry.active == 0 and entry.unloading:
            self._schedule_drop(entry)

    async def unload(self, name: str) -> bool:
        """Abort the requests using `name`, then free its slot once the engine has dropped their
        sequences; returns when the slot is free. False when it is not here."""
        entry = self.entries.get(name)
        if entry is None:
            return False
        if not entry.unloading:
            entry.unloading = True
            entry.dropped = asyncio.get_running_loop().create_future()
            for queue in entry.holders:
                queue.put_nowait(unloaded(name))
            if entry.active == 0:
                self._schedule_drop(entry)
        assert entry.dropped is not None
        await asyncio.shield(entry.dropped)
        return True

    def _schedule_drop(self, entry: AdapterEntry) -> None:
        task = asyncio.get_running_loop().create_task(self._drop(entry))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors land in entry.dropped

    async def _drop(self, entry: AdapterEntry) -> None:
        assert entry.dropped is not None
        try:
            await asyncio.to_thread(self.engine.unload_lora, entry.slot)
        except BaseException as exc:
            log.warning("unloading LoRA adapter %r failed: %s", entry.name, exc)
            if not entry.dropped.done():
                entry.dropped.set_exception(exc)
            raise
        finally:
            if self.entries.get(entry.name) is entry:
                del self.entries[entry.name]
        if not entry.dropped.done():
            entry.dropped.set_result(None)
