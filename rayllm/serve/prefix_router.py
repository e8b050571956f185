"""Ray Serve request router for the model deployments: prefix-cache affinity with a bounded load imbalance.

It runs inside each caller's deployment handle (the ingress replica's handle to a model deployment), so
its table is that caller's view of what it sent where; one ingress replica (the default) sees everything.
The routing key costs no extra call: the ingress sends `generate` a GenerateRequest whose prompts are
already token ids, chained into block hashes here (rayllm.serve.prefix_affinity).

Order of preference: Serve's multiplexed-model affinity first (LoRA adapters: replicas holding the
adapter, with Serve's own timeouts and fallbacks), then the prefix rule among those candidates. Calls
that carry no prompt (stats, model_info, embeddings, adapter loads) go through Serve's power of two choices.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from rayllm.protocol.io_struct import GenerateRequest
from rayllm.serve.prefix_affinity import PrefixTable, RouterConfig, block_chain, pick

ROUTER_CLASS = "rayllm.serve.prefix_router:PrefixRouter"
RESERVATION_S = 1.0  # a choice not sent (the replica was full), or a send not answered, stops counting after this


def request_router_config(router: RouterConfig, block_size: int) -> dict[str, Any]:
    """The deployment's `request_router_config` option (kwargs are JSON, as Serve requires)."""
    kwargs = {"block_size": block_size, "min_match_tokens": router.min_match_tokens,
              "max_imbalance": router.max_imbalance, "max_load_ratio": router.max_load_ratio,
              "max_blocks_per_replica": router.max_blocks_per_replica,
              "max_prompt_blocks": router.max_prompt_blocks}
    return {"request_router_class": ROUTER_CLASS, "request_router_kwargs": kwargs}


def routing_key(pending: PendingRequest | None, block_size: int, max_blocks: int) -> list[int] | None:
    """The block chain of a generate call's first prompt, in its adapter's and cache salt's namespace."""
    args = pending.args if pending is not None else None
    req = args[0] if args else None
    if not isinstance(req, GenerateRequest) or not req.prompts:
        return None
    return block_chain(req.prompts[0], block_size, (req.lora, req.params.cache_salt), max_blocks)


class PrefixRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Not FIFO on purpose: a replica chosen for one request's prefix must serve that request."""

    def initialize_state(self, block_size: int = 16, **kwargs: Any) -> None:
        self.block_size = block_size
        self.config = RouterConfig.from_value({"policy": "prefix", **kwargs})
        self.table = PrefixTable(self.config.max_blocks_per_replica)
        self.rng = random.Random()
        # This router's own count per replica, so that a burst routed at once sees itself: choices not yet
        # sent, requests sent but not yet accepted (times; dropped after RESERVATION_S, as when Serve sent
        # it elsewhere or the replica refused it), and accepted requests not yet finished. Serve's cache
        # alone undercounts a burst: a replica's answer to one request overwrites it with the count the
        # replica saw then, without the requests still on their way to it.
        self.reserved: dict[ReplicaID, deque[float]] = {}
        self.sent: dict[ReplicaID, deque[float]] = {}
        self.accepted: dict[ReplicaID, int] = {}

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        chain = routing_key(pending_request, self.block_size, self.config.max_prompt_blocks)
        if chain is None:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        assert pending_request is not None
        if pending_request.metadata.multiplexed_model_id:
            ids = self.apply_multiplex_routing(pending_request=pending_request)
            candidates = [r for r in candidate_replicas if r.replica_id in ids]
        else:
            candidates = list(candidate_replicas)
        pending_request.routing_context.should_backoff = True  # a refused choice waits before the next try
        loads = await self._loads(candidates)
        if not loads:  # none known with room: Serve's probing and backoff take over
            return [candidates]
        matched = self.table.match(chain, list(loads))
        chosen = pick(matched, loads, self.block_size, self.config, self.rng)
        # Counted from now, not from when it is sent: requests routed in between must see it.
        self.reserved.setdefault(chosen, deque()).append(time.monotonic())
        rest = sorted((r for r in candidates if r.replica_id != chosen), key=lambda r: loads.get(r.replica_id, 1 << 30))
        return [[self._replicas[chosen]], rest] if rest else [[self._replicas[chosen]]]

    async def _loads(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per candidate with room for one more: the router's cache (updated as requests
        are sent, finish and are accepted), probing those it has no fresh entry for."""
        loads: dict[ReplicaID, int] = {}
        unknown: list[RunningReplica] = []
        for r in candidates:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                unknown.append(r)
            elif q < r.max_ongoing_requests:
                loads[r.replica_id] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None and q < r.max_ongoing_requests:
                    loads[r.replica_id] = q
        now = time.monotonic()
        for rid in loads:
            own = self.accepted.get(rid, 0) + len(_fresh(self.sent.get(rid), now))
            loads[rid] = max(loads[rid], own) + len(_fresh(self.reserved.get(rid), now))
        return {rid: q for rid, q in loads.items() if rid in self._replicas}

    def on_send_request(self, replica_id: ReplicaID) -> None:
        """Sent: its reservation becomes a send awaiting the replica's answer."""
        pending = self.reserved.get(replica_id)
        if pending:
            pending.popleft()
        self.sent.setdefault(replica_id, deque()).append(time.monotonic())
        super().on_send_request(replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        """The replica accepted the request: it counts until it finishes, and the replica will hold the
        prompt's blocks (until its cache evicts them)."""
        sent = self.sent.get(replica_id)
        if sent:
            sent.popleft()
        self.accepted[replica_id] = self.accepted.get(replica_id, 0) + 1
        chain = routing_key(pending_request, self.block_size, self.config.max_prompt_blocks)
        if chain:
            self.table.insert(replica_id, chain)

    def decrement_queue_len_cache(self, replica_id: ReplicaID) -> None:
        """A sent request finished (Serve calls this for accepted requests, and for every request where
        replicas cannot refuse one, which never reach on_request_routed)."""
        if self.accepted.get(replica_id, 0) > 0:
            self.accepted[replica_id] -= 1
        elif self.sent.get(replica_id):
            self.sent[replica_id].popleft()
        super().decrement_queue_len_cache(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "table"):  # before initialize_state
            return
        for gone in set(self.table.lru) - self._replica_id_set:
            self.table.remove(gone)
        for own in (self.reserved, self.sent, self.accepted):
            for gone in set(own) - self._replica_id_set:
                del own[gone]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "table"):
            self.table.remove(replica_id)
            for own in (self.reserved, self.sent, self.accepted):
                own.pop(replica_id, None)


def _fresh(times: deque[float] | None, now: float) -> deque[float]:
    """Drops the entries older than RESERVATION_S; returns what is left."""
    if times is None:
        return deque()
    while times and now - times[0] > RESERVATION_S:
        times.popleft()
    return times
