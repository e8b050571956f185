"""The prefix router's load accounting, without starting Ray: Serve's own RequestRouter machinery (its routing
loop, queue-length cache, multiplex mixin) around rayllm.serve.prefix_router.PrefixRouter, with the hooks called
in the order Serve's router (ray.serve._private.router, `_route_and_send_request_once`) calls them. Only the
replica actors are stand-ins: they answer the router's queue-length probes."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from rayllm.protocol.io_struct import GenerateRequest, StopOptions
from rayllm.schema.sampling_params import SamplingParams
from rayllm.serve.prefix_affinity import RouterConfig
from rayllm.serve.prefix_router import PrefixRouter

DEPLOYMENT = DeploymentID(name="llm", app_name="app")
B = 4  # block size
PROMPT = list(range(3 * B))  # three blocks: a match of 12 tokens >= min_match_tokens


class Replica:
    """A model replica as the router sees it: an id, a limit, adapters, and its answer to a probe (the requests
    it is running, which the test keeps as Serve's replica would)."""

    def __init__(self, name: str, max_ongoing: int = 64, adapters: frozenset[str] = frozenset()) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.max_ongoing_requests = max_ongoing
        self.multiplexed_model_ids = set(adapters)
        self.node_id, self.availability_zone = "node", None
        self.running: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return len(self.running)


def router(config: RouterConfig, *replicas: Replica, cls: type[PrefixRouter] = PrefixRouter) -> PrefixRouter:
    """As Serve builds a deployment's router from `request_router_config` (queue-length cache on, as with
    max_ongoing_requests enforced)."""
    r = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
    r.initialize_state(block_size=B, min_match_tokens=config.min_match_tokens, max_imbalance=config.max_imbalance,
                       max_load_ratio=config.max_load_ratio)
    r.update_replicas(list(replicas))
    for rep in replicas:  # Serve probes new replicas; the answers are in the cache before the first request
        r.on_new_queue_len_info(rep.replica_id, len(rep.running))
    return r


def request(method: str, prompt: list[int] | None = None, lora: str | None = None) -> PendingRequest:
    """A handle call as the ingress makes it: `generate` with a GenerateRequest of token ids, or another method."""
    args: list = []
    if method == "generate":
        args = [GenerateRequest(uuid.uuid4().hex, [prompt], SamplingParams(), StopOptions(), lora=lora)]
    meta = RequestMetadata(request_id=uuid.uuid4().hex, internal_request_id=uuid.uuid4().hex, call_method=method,
                           multiplexed_model_id=lora or "")
    return PendingRequest(args=args, kwargs={}, metadata=meta)


class Serve:
    """Serve's router's side of each call (`_route_and_send_request_once` with rejection): route through the
    request router, send (the replica starts counting it), the replica's answer, its completion."""

    def __init__(self, r: PrefixRouter) -> None:
        self.r = r

    async def route(self, pr: PendingRequest) -> Replica:
        """Serve's routing loop (choose_replicas, then the candidates' cache or probes) and the caller's send."""
        replica = await self.r._choose_replica_for_request(pr)
        self.send(pr, replica)
        return replica

    def send(self, pr: PendingRequest, replica: Replica) -> None:
        replica.running.add(pr.metadata.internal_request_id)
        self.r.on_send_request(replica.replica_id)

    def answer(self, pr: PendingRequest, replica: Replica) -> None:
        self.r.on_new_queue_len_info(replica.replica_id, len(replica.running))
        self.r.on_request_routed(pr, replica.replica_id, None)

    def finish(self, pr: PendingRequest, replica: Replica) -> None:
        replica.running.discard(pr.metadata.internal_request_id)
        self.r.decrement_queue_len_cache(replica.replica_id)
        self.r.on_request_completed(replica.replica_id, pr.metadata.internal_request_id)

    async def loads(self, *replicas: Replica) -> list[int]:
        """The load the router would compare for each replica now."""
        loads = await self.r._loads(list(replicas))
        return [loads[rep.replica_id] for rep in replicas]


async def home_of(serve: Serve, prompt: list[int]) -> Replica:
    """A replica that holds `prompt` (one generate request there, answered and finished; all in one step of
    the event loop, before the router's callback on its routing future runs: the hooks settle it first)."""
    pr = request("generate", prompt)
    home = await serve.route(pr)
    serve.answer(pr, home)
    serve.finish(pr, home)
    return home


def test_a_call_without_a_prompt_does_not_release_a_generate_request_s_reservation():
    """The defect: a stats call sent to a replica while a generate request chosen for it is not yet sent took
    that request's reservation, so the next request saw the replica one request lighter and went there over
    the bound."""
    async def run() -> None:
        a, b = Replica("a"), Replica("b")
        r = router(RouterConfig(min_match_tokens=B, max_imbalance=1, max_load_ratio=1.0), a, b)
        serve = Serve(r)
        home = await home_of(serve, PROMPT)
        other = b if home is a else a
        first = request("generate", PROMPT)
        assert (await r.choose_replicas(r._replicas_list, first))[0] == [home]  # chosen, not sent yet
        stats = request("model_info")
        stats.future.set_result(home)  # Serve's power of two choices picked `home` for it
        serve.send(stats, home)
        assert await serve.loads(home, other) == [2, 0]
        second = request("generate", PROMPT)
        assert (await r.choose_replicas(r._replicas_list, second))[0] == [other]  # home is over the bound
        assert await serve.loads(home, other) == [2, 1]

    asyncio.run(run())


def test_a_request_chosen_twice_or_sent_elsewhere_holds_one_reservation_until_it_is_sent():
    """Serve's routing loop calls choose_replicas again while the chosen replica is full (backoff, or a LoRA
    request's next multiplex tier), and sends to its second rank when the first refuses: each request holds
    one reservation, which its own send releases, wherever it went."""
    async def run() -> None:
        a, b = Replica("a"), Replica("b")
        r = router(RouterConfig(min_match_tokens=B, max_imbalance=4, max_load_ratio=1.0), a, b)
        serve = Serve(r)
        home = await home_of(serve, PROMPT)
        other = b if home is a else a
        x, y = request("generate", PROMPT), request("generate", PROMPT)
        for _ in range(3):
            assert (await r.choose_replicas(r._replicas_list, x))[0] == [home]
        assert await serve.loads(home, other) == [1, 0]
        assert (await r.choose_replicas(r._replicas_list, y))[0] == [home]
        assert await serve.loads(home, other) == [2, 0]
        x.future.set_result(other)  # Serve took x's second rank
        serve.send(x, other)
        await asyncio.sleep(0)
        assert await serve.loads(home, other) == [1, 1]  # y still reserved on home, x sent to other
        y.future.set_result(home)
        serve.send(y, home)
        await asyncio.sleep(0)
        assert await serve.loads(home, other) == [1, 1]
        serve.answer(y, home)
        serve.finish(y, home)
        serve.answer(x, other)
        serve.finish(x, other)
        assert await serve.loads(home, other) == [0, 0]

    asyncio.run(run())


def test_a_refused_attempt_s_late_completion_does_not_end_its_retry_s_count():
    """A replica refuses a request (full when it arrived); Serve routes it again, and reports the refused
    attempt's end (its completion callback) only after the retry was sent, here to the same replica."""
    async def run() -> None:
        a, b = Replica("a"), Replica("b")
        r = router(RouterConfig(min_match_tokens=B, max_imbalance=4, max_load_ratio=1.0), a, b)
        serve = Serve(r)
        home = await home_of(serve, PROMPT)
        other = b if home is a else a
        x = request("generate", PROMPT)
        assert await serve.route(x) is home
        home.running.discard(x.metadata.internal_request_id)  # refused: the replica does not run it
        r.on_new_queue_len_info(home.replica_id, len(home.running))  # its answer; no on_request_routed
        x.reset_future()  # Serve's retry of the same request
        retry = await r._choose_replica_for_request(x, is_retry=True)
        serve.send(x, retry)
        assert retry is home
        r.on_request_completed(home.replica_id, x.metadata.internal_request_id)  # the refused attempt's end
        assert await serve.loads(home, other) == [1, 0]
        serve.answer(x, home)
        assert await serve.loads(home, other) == [1, 0]
        serve.finish(x, home)
        assert await serve.loads(home, other) == [0, 0]

    asyncio.run(run())


def test_a_replica_that_leaves_takes_its_counts_and_reservations_with_it():
    async def run() -> None:
        a, b, c = Replica("a"), Replica("b"), Replica("c")
        r = router(RouterConfig(min_match_tokens=B, max_imbalance=4, max_load_ratio=1.0), a, b)
        serve = Serve(r)
        home = await home_of(serve, PROMPT)
        other = b if home is a else a
        running, waiting = request("generate", PROMPT), request("generate", PROMPT)
        assert await serve.route(running) is home
        serve.answer(running, home)
        assert (await r.choose_replicas(r._replicas_list, waiting))[0] == [home]
        r.update_replicas([other, c])  # home left (scaled down, or its node died)
        r.on_new_queue_len_info(c.replica_id, 0)
        assert all(not own.get(home.replica_id) for own in (r.ledger.reserved, r.ledger.sent, r.ledger.accepted))
        assert home.replica_id not in r.ledger.chosen.values() and home.replica_id not in r.ledger.placed.values()
        # Serve routes the waiting request again, among the replicas left: it counts once, where it went
        again = (await r.choose_replicas(r._replicas_list, waiting))[0][0]
        rest = c if again is other else other
        assert await serve.loads(again, rest) == [1, 0]
        waiting.future.set_result(again)
        serve.send(waiting, again)
        await asyncio.sleep(0)
        serve.finish(running, home)  # the request on the departed replica ends: nothing else moves
        assert await serve.loads(again, rest) == [1, 0]

    asyncio.run(run())


class Observed(PrefixRouter):
    """The router, recording at each choice the loads it compares beside the test's count of the same moment."""

    truth: Callable[[], dict[ReplicaID, int]]

    async def _loads(self, candidates: list) -> dict[ReplicaID, int]:
        loads = await super()._loads(candidates)
        truth = self.truth()
        self.checks.append((loads, {rid: truth[rid] for rid in loads}))
        return loads


def test_every_choice_counts_each_generate_request_once_in_a_mixed_concurrent_burst():
    """Serve's routing loop with concurrent generate requests (some for a LoRA adapter, held by two replicas),
    calls without a prompt, answers and completions in random order, a replica leaving and another joining.
    At every choice, a candidate's load is Serve's count (the replicas' last answers, moved by each send and
    completion) or, if higher, the generate requests sent there and not finished, plus the generate requests
    Serve assigned it that are not sent yet: each generate request counts once, a call without a prompt
    only in Serve's count."""
    async def run(seed: int) -> int:
        rng = random.Random(seed)
        random.seed(seed)  # Serve's power of two choices
        reps = [Replica("a", adapters=frozenset({"lora-x"})), Replica("b", adapters=frozenset({"lora-x"})),
                Replica("c"), Replica("d")]
        r = router(RouterConfig(min_match_tokens=B, max_imbalance=2, max_load_ratio=1.5), *reps[:3], cls=Observed)
        r.rng.seed(seed)
        r.ledger.ttl_s = 3600.0  # no expiry on a slow machine: every request here is answered at once
        serve = Serve(r)
        unsent: dict[str, PendingRequest] = {}  # generate requests not sent yet
        generating: dict[str, Replica] = {}  # generate requests sent and not finished

        def truth() -> dict[ReplicaID, int]:
            mine = {rep.replica_id: 0 for rep in reps}
            for rep in generating.values():
                mine[rep.replica_id] += 1
            counts = {rid: max(r.replica_queue_len_cache.get(rid) or 0, n) for rid, n in mine.items()}
            for pr in unsent.values():
                if pr.future.done() and not pr.future.cancelled():
                    counts[pr.future.result().replica_id] += 1
            return counts

        r.truth = truth
        r.checks = []
        stems = [[rng.randrange(50) for _ in range(4 * B)] for _ in range(3)]

        async def call(i: int) -> None:
            for _ in range(rng.randrange(40)):
                await asyncio.sleep(0)
            generate = rng.random() < 0.7
            if generate:
                stem = rng.choice(stems)
                pr = request("generate", stem[:rng.randrange(len(stem))] + [i], rng.choice([None, None, "lora-x"]))
                unsent[pr.metadata.internal_request_id] = pr
            else:
                pr = request(rng.choice(["model_info", "embed", "load_lora_adapter"]))
            replica = await r._choose_replica_for_request(pr)
            if generate:
                del unsent[pr.metadata.internal_request_id]
                generating[pr.metadata.internal_request_id] = replica
            serve.send(pr, replica)
            await asyncio.sleep(0)  # Serve awaits the replica's answer
            serve.answer(pr, replica)
            for _ in range(rng.randrange(30)):
                await asyncio.sleep(0)
            generating.pop(pr.metadata.internal_request_id, None)
            serve.finish(pr, replica)

        async def scale() -> None:
            for _ in range(20):
                await asyncio.sleep(0)
            r.update_replicas([reps[0], reps[1], reps[3]])  # c leaves, d joins

        await asyncio.gather(scale(), *(call(i) for i in range(150)))
        for loads, expected in r.checks:
            assert loads == expected
        assert await serve.loads(reps[0], reps[1], reps[3]) == [0, 0, 0]
        return len(r.checks)

    assert sum(asyncio.run(run(seed)) for seed in range(5)) > 300
