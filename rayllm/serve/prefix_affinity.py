"""Prefix-cache affinity, without Ray: which replica most likely holds a prompt's prefix, and the choice rule.

The router (rayllm.serve.prefix_router) remembers, per model replica, the KV blocks of the prompts it sent
there: each full block of `block_size` tokens is named by a hash chained over every block before it (as
the engine's block manager names its cached blocks), so one dictionary lookup per block finds the
replicas holding a prompt's prefix up to that block. The table is bounded per replica (least recently
routed blocks go first), as the replica's own cache is.

The choice rule (`pick`) is the bounded-imbalance rule of docs/routing-priority-tracing.md.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

POLICIES = ("prefix", "power_of_two")


@dataclass(frozen=True)
class RouterConfig:
    """cluster.yaml's `router` (an app arg): `router: prefix`, or a mapping of these fields."""

    # prefix: prefix-cache affinity within the load bound; power_of_two: Serve's default router.
    policy: str = "prefix"
    # A shorter match is not worth a busier replica: the least-loaded replica takes the request.
    min_match_tokens: int = 64
    # The bound: a request goes to a replica with at most this many more ongoing requests than the
    # least-loaded one (queue lengths as Serve's router sees them), or at most `max_load_ratio` times as
    # many, whichever allows more (SGLang's and vLLM's routers combine an absolute and a relative bound the
    # same way): at 30 ongoing requests a gap of 4 is noise, and moving a conversation costs its history.
    max_imbalance: int = 4
    max_load_ratio: float = 1.5
    # Blocks remembered per replica (LRU); 65536 blocks of 16 tokens is 1M tokens, ~25 MB of table per replica
    # when every block is distinct (tracemalloc; shared prefixes take less).
    max_blocks_per_replica: int = 65536
    # Blocks of a prompt hashed per request (bounds the router's work on long prompts).
    max_prompt_blocks: int = 2048

    @classmethod
    def from_value(cls, value: Any) -> RouterConfig:
        """None = the defaults; a string names the policy; a mapping sets fields. Errors name the field."""
        if value is None:
            return cls()
        if isinstance(value, str):
            value = {"policy": value}
        if not isinstance(value, Mapping):
            raise ValueError(f"router must be one of {', '.join(POLICIES)} or a mapping, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown keys in router: {sorted(unknown)} (known: {sorted(known)})")
        config = cls(**value)
        if config.policy not in POLICIES:
            raise ValueError(f"router.policy must be one of {', '.join(POLICIES)}, got {config.policy!r}")
        for name, low in (("min_match_tokens", 0), ("max_imbalance", 0), ("max_blocks_per_replica", 1),
                          ("max_prompt_blocks", 1)):
            v = getattr(config, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"router.{name} must be an integer >= {low}, got {v!r}")
        ratio = config.max_load_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 1.0 <= ratio <= 100.0:
            raise ValueError(f"router.max_load_ratio must be a number from 1 to 100, got {ratio!r}")
        return config

    def max_load(self, least: int) -> int:
        """The most ongoing requests a replica may have to be chosen, when the least loaded has `least`."""
        return max(least + self.max_imbalance, int(least * self.max_load_ratio))


def block_chain(tokens: Sequence[int], block_size: int, namespace: Hashable = None,
                max_blocks: int | None = None) -> list[int]:
    """One hash per full block, each covering every token before it too; `namespace` (adapter, cache salt)
    starts the chain, so prompts of different namespaces never match (as in the engine's cache)."""
    n = len(tokens) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    chain: list[int] = []
    prev: Hashable = ("ns", namespace)
    for i in range(n):
        prev = hash((prev, tuple(tokens[i * block_size:(i + 1) * block_size])))
        chain.append(prev)  # type: ignore[arg-type]
    return chain


class PrefixTable:
    """Which replicas were sent which blocks: block hash -> replicas, and per replica an LRU of its blocks."""

    def __init__(self, max_blocks_per_replica: int) -> None:
        self.capacity = max_blocks_per_replica
        self.holders: dict[int, set[Hashable]] = {}
        self.lru: dict[Hashable, OrderedDict[int, None]] = {}

    def match(self, chain: Sequence[int], replicas: Sequence[Hashable]) -> dict[Hashable, int]:
        """Leading blocks of `chain` each replica holds (the walk stops where no candidate holds one)."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for depth, h in enumerate(chain):
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for r in alive:
                out[r] = depth + 1
        return out

    def insert(self, replica: Hashable, chain: Sequence[int]) -> None:
        """The replica computed (or reused) these blocks; they become its most recently used."""
        lru = self.lru.setdefault(replica, OrderedDict())
        for h in chain:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self.holders.setdefault(h, set()).add(replica)
        while len(lru) > self.capacity:
            old, _ = lru.popitem(last=False)
            self._drop(old, replica)

    def remove(self, replica: Hashable) -> None:
        """A replica left: its blocks are forgotten."""
        for h in self.lru.pop(replica, {}):
            self._drop(h, replica)

    def _drop(self, h: int, replica: Hashable) -> None:
        holders = self.holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[h]

    def num_blocks(self, replica: Hashable) -> int:
        return len(self.lru.get(replica, ()))


def pick(matched: Mapping[Hashable, int], loads: Mapping[Hashable, int], block_size: int, config: RouterConfig,
         rng: random.Random | None = None) -> Hashable:
    """The replica for a request, from each candidate's matched blocks and ongoing requests (all known and
    below their limit). Among replicas within the load bound (`RouterConfig.max_load`), the longest match wins
    (then the lower load); a winning match under `min_match_tokens` sends the request to the least loaded
    instead (then the longer match). Remaining ties are broken at random, so equal replicas share load."""
    rng = rng or random
    low = min(loads.values())
    near = [r for r in loads if loads[r] <= config.max_load(low)]
    order = list(near)
    rng.shuffle(order)  # a stable max over a shuffled list: ties go to a random replica
    best = max(order, key=lambda r: (matched.get(r, 0), -loads[r]))
    if matched.get(best, 0) * block_size >= max(config.min_match_tokens, 1):
        return best
    return max(order, key=lambda r: (-loads[r], matched.get(r, 0)))
