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
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from app.errors import APIError
from model_parallel.config import LoRAConfig
from model_parallel.lora import LoRAError, read_peft_adapter

log = logging.getLogger("ray.serve")


@dataclass
class AdapterEntry:
    name: str
    path: str
    lora_id: int  # what sequences carry; unique per load
    slot: int  # 1..max_loras
    rank: int
    active: int = 0  # requests in flight
    unloading: bool = False  # unload asked while in use: freed when the last request ends
    loaded_at: float = field(default_factory=time.time)

    def card(self) -> dict:
        return {"name": self.name, "path": self.path, "slot": self.slot, "rank": self.rank, "active": self.active}


def invalid_adapter(message: str) -> APIError:
    return APIError(400, message, param="lora_path", code="invalid_lora_adapter")


class LoRARegistry:
    """Adapters resident on one replica; `engine` is the replica's LLMEngine (arch + executor)."""

    def __init__(self, config: LoRAConfig, engine, on_evict: Callable[[str], None] | None = None):
        self.config = config
        self.engine = engine
        self.on_evict = on_evict  # tells Serve's multiplexing cache that the name is gone
        self.entries: OrderedDict[str, AdapterEntry] = OrderedDict()  # least recently used first
        self._next_id = 1
        self._lock = asyncio.Lock()  # one load at a time: slot choice and weight copies do not interleave

    def names(self) -> list[str]:
        return [n for n, e in self.entries.items() if not e.unloading]

    def _take_slot(self) -> int | None:
        """A free slot, or the slot of the least recently used idle adapter (evicted)."""
        used = {e.slot for e in self.entries.values()}
        for slot in range(1, self.config.max_loras + 1):
            if slot not in used:
                return slot
        for name, entry in self.entries.items():
            if entry.active == 0:
                del self.entries[name]
                log.info("LoRA adapter %r evicted (least recently used) from slot %d", name, entry.slot)
                if self.on_evict is not None:
                    self.on_evict(name)
                return entry.slot
        return None

    def _validate(self, name: str, path: str) -> int:
        """Read and check the files here first (clear errors, and nothing is evicted for a bad adapter)."""
        try:
            return read_peft_adapter(path, self.engine.arch, self.config.max_lora_rank).rank
        except LoRAError as exc:
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None

    def _write(self, name: str, path: str, slot: int, rank: int) -> AdapterEntry:
        """Every TP rank reads its own shard of the files into `slot`."""
        lora_id = self._next_id
        self._next_id += 1
        try:
            self.engine.executor.load_lora(slot, lora_id, path)
        except LoRAError as exc:  # the files changed since _validate
            raise invalid_adapter(f"LoRA adapter {name!r}: {exc}") from None
        return AdapterEntry(name, path, lora_id, slot, rank)

    def load_now(self, name: str, path: str) -> AdapterEntry:
        """Synchronous load at replica start (adapters named in cluster.yaml); errors fail the replica."""
        rank = self._validate(name, path)
        slot = self._take_slot()
        if slot is None:
            raise ValueError(f"no free LoRA slot for {name!r} (lora.max_loras={self.config.max_loras})")
        entry = self._write(name, path, slot, rank)
        self.entries[name] = entry
        return entry

    async def load(self, name: str, path: str) -> AdapterEntry:
        """Make `name` resident (from `path`); a no-op when it already is, from the same path."""
        entry = self.entries.get(name)
        if entry is not None and entry.path == path:
            entry.unloading = False
            self.entries.move_to_end(name)
            return entry
        async with self._lock:
            entry = self.entries.get(name)
            if entry is not None and entry.path == path:
                entry.unloading = False
                self.entries.move_to_end(name)
                return entry
            rank = await asyncio.to_thread(self._validate, name, path)
            if entry is not None:  # same name, new files
                if entry.active:
                    raise APIError(409, f"LoRA adapter {name!r} is in use with other files; retry later",
                                   type="conflict_error", param="lora_path")
                del self.entries[name]
                slot: int | None = entry.slot
            else:
                slot = self._take_slot()
            if slot is None:
                raise APIError(503, f"all {self.config.max_loras} LoRA adapter slots are in use by running "
                               "requests; retry later", type="server_error", code="lora_slots_busy")
            new = await asyncio.to_thread(self._write, name, path, slot, rank)
            self.entries[name] = new
            log.info("LoRA adapter %r (rank %d) loaded into slot %d from %s", name, new.rank, slot, path)
            return new

    async def acquire(self, name: str, path: str) -> AdapterEntry:
        """Load if needed and count one request in flight; pair with release()."""
        entry = await self.load(name, path)
        entry.active += 1
        return entry

    def release(self, entry: AdapterEntry) -> None:
        entry.active -= 1
        if entry.active == 0 and entry.unloading:
            self._drop(entry)

    def unload(self, name: str) -> bool:
        """Forget `name` now, or once its running requests end; False when it is not here."""
        entry = self.entries.get(name)
        if entry is None or entry.unloading:
            return False
        if entry.active:
            entry.unloading = True
        else:
            self._drop(entry)
        return True

    def _drop(self, entry: AdapterEntry) -> None:
        if self.entries.get(entry.name) is entry:
            del self.entries[entry.name]
        # The slot is free from here on; zeroing it is hygiene (a later load overwrites it anyway).
        self.engine.executor.unload_lora(entry.slot)
