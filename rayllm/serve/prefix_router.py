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

import asyncio
import random
import time
from collections import Counter
from functools import partial
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


class Ledger:
    """The generate requests this router counts per replica, each by its Serve request id: chosen and not yet
    sent (reservations, which Serve's cache cannot count yet), sent and not yet answered, accepted and not
    yet finished. Keyed by request, so that a call without a prompt (stats, adapter loads), a request sent
    to another replica than the one chosen, or a request chosen again never moves another request's count."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.reserved: dict[ReplicaID, dict[str, float]] = {}  # replica -> request -> when chosen, oldest first
        self.sent: dict[ReplicaID, dict[str, float]] = {}  # replica -> request -> when sent, oldest first
        self.accepted: dict[ReplicaID, set[str]] = {}
        self.chosen: dict[str, ReplicaID] = {}  # request -> the replica of its reservation
        self.placed: dict[str, ReplicaID] = {}  # request -> the replica it was sent to (sent or accepted)
        # A refused attempt's completion may reach the router after the retry was sent (to any replica):
        # it must not end the retry's count.
        self.stale: Counter[tuple[ReplicaID, str]] = Counter()

    def reserve(self, request: str, replica: ReplicaID, now: float) -> None:
        self.release(request)
        self.reserved.setdefault(replica, {})[request] = now
        self.chosen[request] = replica

    def release(self, request: str) -> None:
        replica = self.chosen.pop(request, None)
        if replica is not None:
            self.reserved.get(replica, {}).pop(request, None)

    def send(self, request: str, replica: ReplicaID, now: float) -> None:
        self.release(request)
        earlier = self.placed.pop(request, None)
        if earlier is not None:  # a refused attempt, its completion still due
            self._unplace(request, earlier)
            self.stale[earlier, request] += 1
        self.sent.setdefault(replica, {})[request] = now
        self.placed[request] = replica

    def accept(self, request: str, replica: ReplicaID) -> None:
        self._unplace(request, replica)
        self.accepted.setdefault(replica, set()).add(request)
        self.placed[request] = replica

    def complete(self, request: str, replica: ReplicaID) -> None:
        if self.stale[replica, request]:
            self.stale[replica, request] -= 1
            if not self.stale[replica, request]:
                del self.stale[replica, request]
        elif self.placed.get(request) == replica:
            del self.placed[request]
            self._unplace(request, replica)

    def counts(self, replica: ReplicaID, now: float) -> tuple[int, int]:
        """(sent or accepted, reserved) for the replica, once the entries older than `ttl_s` are dropped."""
        for own, index in ((self.reserved, self.chosen), (self.sent, self.placed)):
            times = own.get(replica, {})
            while times:
                request, t = next(iter(times.items()))
                if now - t <= self.ttl_s:
                    break
                del times[request]
                if index.get(request) == replica:
                    del index[request]
        return len(self.accepted.get(replica, ())) + len(self.sent.get(replica, ())), \
            len(self.reserved.get(replica, ()))

    def forget(self, keep: set[ReplicaID]) -> None:
        """Replicas not in `keep` left: nothing counts for them any more."""
        for own in (self.reserved, self.sent, self.accepted):
            for gone in set(own) - keep:
                del own[gone]
        for index in (self.chosen, self.placed):
            for request in [q for q, replica in index.items() if replica not in keep]:
                del index[request]
        for key in [k for k in self.stale if k[0] not in keep]:
            del self.stale[key]

    def _unplace(self, request: str, replica: ReplicaID) -> None:
        self.sent.get(replica, {}).pop(request, None)
        self.accepted.get(replica, set()).discard(request)


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
        # This router's own count per replica, so that a burst routed at once sees itself. Serve's cache alone
        # undercounts a burst: it counts a request from its send on, and a replica's answer to one request
        # overwrites it with the count the replica saw then, without the requests still on their way to it.
        self.ledger = Ledger(RESERVATION_S)
        self.watched: dict[str, asyncio.Future] = {}  # request -> the routing future its reservation waits on

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
        self._reserve(pending_request, chosen)
        rest = sorted((r for r in candidates if r.replica_id != chosen), key=lambda r: loads.get(r.replica_id, 1 << 30))
        return [[self._replicas[chosen]], rest] if rest else [[self._replicas[chosen]]]

    async def _loads(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests per candidate with room for one more: the router's cache (updated as requests
        are sent, finish and are accepted), probing those it has no fresh entry for, plus this router's
        own counts. All read after the probes, at one moment: requests sent or finished while a probe was
        on its way count as they stand when the choice is made."""
        cache = self._replica_queue_len_cache
        use_cache = self._use_replica_queue_len_cache
        unknown = [r for r in candidates if not use_cache or cache.get(r.replica_id) is None]
        probed = {r.replica_id: q for r, q in await self._probe_queue_lens(unknown, 0)} if unknown else {}
        now = time.monotonic()
        loads: dict[ReplicaID, int] = {}
        for r in candidates:
            rid = r.replica_id
            q = cache.get(rid) if use_cache else None
            q = probed.get(rid) if q is None else q
            if q is None or q >= r.max_ongoing_requests or rid not in self._replicas:
                continue
            own, reserved = self.ledger.counts(rid, now)
            loads[rid] = max(q, own) + reserved
        return loads

    def _reserve(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """Counted from now, not from when it is sent: requests routed in between must see it. Serve resolves
        the request's routing future with the replica it sends it to: the caller awaiting the future sends it
        (on_send_request, Serve's count) in the event loop's callback just before `_routed` (this router's),
        so no choice in between sees the request counted twice or not at all."""
        request = pending_request.metadata.internal_request_id
        self.ledger.reserve(request, replica_id, time.monotonic())
        if self.watched.get(request) is not pending_request.future:  # once per routing attempt
            self.watched[request] = pending_request.future
            pending_request.future.add_done_callback(partial(self._routed, request))

    def _routed(self, request: str, future: asyncio.Future) -> None:
        """Serve assigned the request a replica (the chosen one or, if that was full, another), or gave up."""
        if self.watched.get(request) is not future:  # settled already, or a later attempt's
            return
        del self.watched[request]
        replica = None if future.cancelled() or future.exception() is not None else future.result()
        if replica is not None and replica.replica_id in self._replica_id_set:
            self.ledger.send(request, replica.replica_id, time.monotonic())
        else:
            self.ledger.release(request)

    def _settle(self, request: str) -> None:
        """A replica answered a request whose future's callback has not run yet: it was sent, count it first."""
        future = self.watched.get(request)
        if future is not None and future.done():
            self._routed(request, future)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        """The replica accepted the request: a generate request counts until it finishes, and the replica will
        hold the prompt's blocks (until its cache evicts them). Other calls count in Serve's cache only."""
        chain = routing_key(pending_request, self.block_size, self.config.max_prompt_blocks)
        if chain is None:
            return
        self._settle(pending_request.metadata.internal_request_id)
        self.ledger.accept(pending_request.metadata.internal_request_id, replica_id)
        if chain:
            self.table.insert(replica_id, chain)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Serve reports every sent request's end (finished, failed, cancelled, or refused by the replica)."""
        if hasattr(self, "ledger"):
            self._settle(internal_request_id)
            self.ledger.complete(internal_request_id, replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if not hasattr(self, "table"):  # before initialize_state
            return
        for gone in set(self.table.lru) - self._replica_id_set:
            self.table.remove(gone)
        self.ledger.forget(self._replica_id_set)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if hasattr(self, "table"):
            self.table.remove(replica_id)
            self.ledger.forget(self._replica_id_set)
