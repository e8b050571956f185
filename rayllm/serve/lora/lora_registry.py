"""Per-replica LoRA adapter registry: name -> slot, LRU eviction of idle adapters, loads on every TP rank.

The registry is the source of truth for what a replica holds. Ray Serve's multiplexing (see
`LLMServer`) only learns from it which adapter names this replica has, so that the router sends
adapter requests to replicas that already hold the adapter.

Each load gets a fresh integer id (never reused). Sequences carry that id as their `lora_slot`, so a
slot refilled with another adapter can never match prefix-cache blocks computed with the old one.

A remote adapter (a client's `lora_path` may name one) is fetched outside the registry's lock, once for
concurrent loads of it, only its two files and only when they are no larger than an adapter for this model
can be (rayllm.loader.adapter_sources); its copy is held on disk while it loads, and the node keeps the
copies of the most recently used few.

When every slot holds an adapter that running requests use, a request for another adapter waits for a slot
(lower `priority` first, then arrival order) for at most SLOT_WAIT_S (the ingress's request_timeout_s ends it
sooner: the request is cancelled, and leaves the queue), then answers 503 lora_slots_busy with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayllm.loader import adapter_sources
from rayllm.loader.model_sources import ModelSourceError
from rayllm.lora.files import MAX_HEADER_BYTES, LoRAError, max_adapter_bytes, read_peft_adapter
from rayllm.protocol.errors import APIError
from rayllm.schema.config import LoRAConfig
from rayllm.serve.lora.adapter_paths import canonical_remote, remote_source, resolve_allowed
from rayllm.serve.lora.registry_errors import (
    FILE_ERRORS,
    SlotsBusy,
    adapter_unavailable,
    copy_removed,
    invalid_adapter,
    source_failure,
    unloaded,
)

if TYPE_CHECKING:
    from rayllm.engine.client.engine_client import EngineClient

log = logging.getLogger("ray.serve")

IDLE_COPIES = 2  # remote adapters' copies kept beyond one per slot: a node keeps max_loras + this many
# Remote adapters fetched or loading at once on a replica: each holds its copy on disk until it is loaded, so
# this bounds what a burst of requests naming new adapters can make the node download and keep.
REMOTE_LOADS = 2
# Seconds a request waits for a LoRA slot when every slot's adapter is in use; then SlotsBusy (503, Retry-After).
SLOT_WAIT_S = 30.0


@dataclass(order=True)
class SlotWaiter:
    """A load waiting for a slot: the first in (priority, arrival) order takes the next one that frees."""

    priority: int
    seq: int
    woken: asyncio.Event = field(compare=False, default_factory=asyncio.Event)


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


def key(path: str) -> str:
    """A path as the registry holds it: a remote source in its canonical spelling, a local one resolved."""
    if remote_source(path):
        return canonical_remote(path) or path  # a malformed one: refused by check_path unless the operator's
    return os.path.realpath(path)


class LoRARegistry:
    """Adapters resident on one replica, loaded through its engine client.

    A slot is freed (or refilled) only once the engine holds no sequence of the adapter it held: a
    request counts as active until every one of its sequences has ended and its abort was submitted
    (release() after the choices' tasks are done). The engine client runs commands in the order they
    were made, so the unload (or the load that refills the slot) reaches the engine after those aborts.
    """

    def __init__(self, config: LoRAConfig, engine: EngineClient, on_evict: Callable[[str], None] | None = None,
                 slot_wait_s: float = SLOT_WAIT_S):
        self.config = config
        self.slot_wait_s = slot_wait_s
        self.engine = engine
        self.on_evict = on_evict  # tells Serve's multiplexing cache that the name is gone
        self.entries: OrderedDict[str, AdapterEntry] = OrderedDict()  # least recently used first
        self.trusted = {key(p) for _, p in config.adapters}  # the operator's: no root needed
        self.keep = config.max_loras + IDLE_COPIES  # remote adapters' copies remembered here and kept on the node
        self._fetched: OrderedDict[str, str] = OrderedDict()  # remote source -> its copy; least recently used first
        self._fetching: dict[str, asyncio.Future[str]] = {}  # downloads in flight, shared by loads of one source
        self._remote_loads = asyncio.Semaphore(REMOTE_LOADS)
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load at a time: slot choice and weight copies do not interleave
        self._waiters: list[SlotWaiter] = []  # loads waiting for a slot (SlotWaiter order)
        self._arrivals = itertools.count()

    def names(self) -> list[str]:
        return [n for n, e in self.entries.items() if not e.unloading]

    def check_path(self, path: str) -> str:
        """The canonical path of an adapter a client named; the uniform 400 outside lora.allowed_roots."""
        canonical = key(path)
        return canonical if canonical in self.trusted else resolve_allowed(path, self.config.allowed_roots)

    def _fetch(self, source: str) -> str:
        """Blocking: this node's copy of a remote source, downloaded if the node lacks it (ModelSourceError)."""
        tensors = max_adapter_bytes(self.engine.arch, self.config.max_lora_rank)
        # The largest files read_peft_adapter could accept: a config and a safetensors header of at most
        # MAX_HEADER_BYTES each, and the tensors of every target module at max_lora_rank.
        limits = {"adapter_config.json": MAX_HEADER_BYTES, "adapter_model.safetensors": 8 + MAX_HEADER_BYTES + tensors}
        return adapter_sources.fetch_adapter(source.removeprefix("hf://"), limits, self.keep).path

    def _hold(self, name: str, local: str) -> contextlib.AbstractContextManager:
        """A hold on a copy just fetched (prune_adapters leaves it while this load reads it)."""
        hold = adapter_sources.hold_adapter(local)
        if hold is None:  # another replica of the node removed it between the fetch and the hold
            raise copy_removed(name)
        return hold

    def _remember(self, source: str, local: str) -> None:
        self._fetched[source] = local
        self._fetched.move_to_end(source)
        while len(self._fetched) > self.keep:
            self._fetched.popitem(last=False)

    async def _download(self, name: str, source: str) -> str:
        """The copy, fetched in a thread, once for every load of `source` that asks while it is fetched."""
        task = self._fetching.get(source)
        if task is None:
            task = self._fetching[source] = asyncio.ensure_future(asyncio.to_thread(self._fetch, source))
            task.add_done_callback(lambda t: (self._fetching.pop(source, None), t.cancelled() or t.exception()))
        try:
            return await asyncio.shield(task)  # a request that leaves does not cancel the others' download
        except ModelSourceError as exc:
            raise source_failure(name, exc) from None

    @contextlib.asynccontextmanager
    async def _copy(self, name: str, path: str) -> AsyncIterator[str]:
        """The files of `path` while the block runs: a local path as it is; a remote source's copy in this
        node's cache, fetched outside the registry's lock and held on disk."""
        if not remote_source(path):
            yield path
            return
        async with self._remote_loads:
            local = self._fetched.get(path)
            hold = adapter_sources.hold_adapter(local) if local is not None else None
            if hold is None:  # not fetched yet, or another replica of the node removed the copy since
                local = await self._download(name, path)
                hold = self._hold(name, local)
            self._remember(path, local)
            with hold:
                yield local

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

    def _validate(self, name: str, local: str) -> int:
        """Read and check the files here first (clear errors, and nothing is evicted for a bad adapter)."""
        try:
            return read_peft_adapter(local, self.engine.arch, self.config.max_lora_rank).rank
        except LoRAError as exc:
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None

    def _write(self, name: str, path: str, local: str, slot: int, rank: int) -> AdapterEntry:
        """Every TP rank reads its own shard of the files (`local`, `path`'s) into `slot`."""
        lora_id = self._next_id
        self._next_id += 1
        try:
            self.engine.load_lora(slot, lora_id, local)
        except LoRAError as exc:  # the files changed since _validate
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None
        return AdapterEntry(name, path, lora_id, slot, rank)

    def load_now(self, name: str, path: str) -> AdapterEntry:
        """Synchronous load at replica start (adapters named in cluster.yaml); errors fail the replica."""
        path = self.check_path(path)  # canonical, as requests' paths are checked against it (_resident)
        local = path
        hold: contextlib.AbstractContextManager = contextlib.nullcontext()
        if remote_source(path):
            try:
                local = self._fetch(path)
            except ModelSourceError as exc:
                raise source_failure(name, exc) from None
            hold = self._hold(name, local)
            self._remember(path, local)
        with hold:
            rank = self._validate(name, local)
            slot = self._take_slot()
            if slot is None:
                raise ValueError(f"no free LoRA slot for {name!r} (lora.max_loras={self.config.max_loras})")
            entry = self._write(name, path, local, slot, rank)
        self.entries[name] = entry
        return entry

    def _resident(self, name: str, path: str) -> AdapterEntry | None:
        entry = self.entries.get(name)
        if entry is not None and entry.path == path and not entry.unloading:
            self.entries.move_to_end(name)
            return entry
        return None

    async def load(self, name: str, path: str, client_path: bool = True, priority: int = 0) -> AdapterEntry:
        """Make `name` resident (from `path`); a no-op when it already is, from the same path (whatever
        the files are now: its weights are in memory). `client_path`: the request itself named `path` (the
        load route, a request's lora_path), so a file problem is its 400 on lora_path; else the server
        registered the adapter and cannot read it here: a 503 naming the adapter (details in the log).
        With no slot free, waits for one in `priority` order (the module docstring)."""
        entry = self._resident(name, key(path))
        if entry is not None:
            return entry
        try:
            path = self.check_path(path)
            async with self._copy(name, path) as local:
                return await self._load(name, path, local, priority)
        except APIError as exc:
            if client_path or exc.code not in FILE_ERRORS:
                raise
            log.warning("registered LoRA adapter %r (%s) cannot be loaded on this replica: %s", name, path,
                        exc.message)
            raise adapter_unavailable(name) from None

    async def _load(self, name: str, path: str, local: str, priority: int) -> AdapterEntry:
        """Load, waiting in line for a slot while every slot's adapter is in use (SlotWaiter)."""
        loop = asyncio.get_running_loop()
        waiter: SlotWaiter | None = None
        deadline = loop.time() + self.slot_wait_s
        rank: int | None = None
        try:
            while True:
                if waiter is not None:
                    waiter.woken.clear()  # before the check: a slot freed after it wakes the wait below
                async with self._lock:
                    entry = self._resident(name, path)
                    if entry is not None:
                        return entry
                    if rank is None:
                        rank = await asyncio.to_thread(self._validate, name, local)
                    entry = await self._fill(name, path, local, rank, waiter)
                    if entry is not None:
                        return entry
                if waiter is None:  # in line now; checks again at once, in case it is first and a slot is free
                    waiter = SlotWaiter(priority, next(self._arrivals))
                    self._waiters.append(waiter)
                    continue
                try:
                    async with asyncio.timeout(deadline - loop.time()):
                        await waiter.woken.wait()
                except TimeoutError:
                    raise SlotsBusy(self.config.max_loras, self.slot_wait_s) from None
        finally:  # loaded, failed, timed out or cancelled (the client left): out of line, holding nothing
            if waiter is not None:
                self._waiters.remove(waiter)
                self._wake()  # the next in line may be first now

    async def _fill(self, name: str, path: str, local: str, rank: int, waiter: SlotWaiter | None
                    ) -> AdapterEntry | None:
        """Under the lock: load into the old slot of `name` or a free (or evicted) one; None when this load
        must wait for a slot (none free, or loads ahead of it in line)."""
        old = self.entries.get(name)
        if old is not None and old.unloading and old.dropped is not None:
            await asyncio.shield(old.dropped)  # an unload of the same name is finishing
            old = None
        if old is not None:  # same name, new files
            if old.active:
                raise APIError(409, f"LoRA adapter {name!r} is in use with other files; retry later",
                               type="conflict_error", param="lora_path")
            del self.entries[name]
            slot: int | None = old.slot
        elif self._waiters and (waiter is None or min(self._waiters) is not waiter):
            return None  # not first in line
        else:
            slot = self._take_slot()
            if slot is None:
                return None
        new = await asyncio.to_thread(self._write, name, path, local, slot, rank)
        self.entries[name] = new
        log.info("LoRA adapter %r (rank %d) loaded into slot %d", name, new.rank, slot)
        return new

    def _wake(self) -> None:
        """A slot may be free (or evictable): every waiter checks again, and the first in line takes it."""
        for waiter in self._waiters:
            waiter.woken.set()

    async def acquire(self, name: str, path: str, queue: asyncio.Queue | None = None,
                      priority: int = 0) -> AdapterEntry:
        """Load if needed and count one request in flight; pair with release(). An unload pushes an
        error into `queue` (the request's output queue), which ends the request."""
        # A request names a directory itself only in lora_path's on-demand form, which names the adapter
        # by its path (AdapterTable.resolve); any other adapter is one the server registered.
        entry = await self.load(name, path, client_path=name == path, priority=priority)
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
        elif entry.active == 0:
            self._wake()  # its slot may be evicted now

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
            self._wake()
        if not entry.dropped.done():
            entry.dropped.set_result(None)
