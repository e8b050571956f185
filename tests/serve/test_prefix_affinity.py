"""The prefix router's choice logic against a brute-force reference: longest common prefix over every prompt
sent to each replica (in whole blocks, per namespace), and the load bound of docs/routing-priority-tracing.md."""

from __future__ import annotations

import random

import pytest

from rayllm.serve.config import ServerConfig
from rayllm.serve.prefix_affinity import PrefixTable, RouterConfig, block_chain, pick

B = 4  # block size: small, so that random prompts share and split blocks often


def lcp_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // B


def reference_match(sent: dict[str, list[tuple[str, list[int]]]], ns: str, prompt: list[int],
                    max_blocks: int) -> dict[str, int]:
    """Per replica: the most leading whole blocks `prompt` shares with any prompt of its namespace sent there."""
    return {r: min(max_blocks, max((lcp_blocks(prompt, p) for n, p in prompts if n == ns), default=0))
            for r, prompts in sent.items()}


def random_prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A stem (shared system prompt / earlier turn) cut at a random point, then fresh tokens."""
    stem = rng.choice(stems)
    return stem[:rng.randrange(len(stem) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(12))]


def test_table_match_equals_brute_force_longest_prefix():
    rng = random.Random(0)
    stems = [[rng.randrange(5) for _ in range(40)] for _ in range(4)]
    replicas = ["r0", "r1", "r2"]
    table = PrefixTable(max_blocks_per_replica=10**9)
    sent: dict[str, list[tuple[str, list[int]]]] = {r: [] for r in replicas}
    for _ in range(400):
        ns = rng.choice(["base", "lora-a"])
        prompt = random_prompt(rng, stems)
        chain = block_chain(prompt, B, ns, max_blocks=8)
        assert table.match(chain, replicas) == reference_match(sent, ns, prompt, 8)
        r = rng.choice(replicas)
        table.insert(r, chain)
        sent[r].append((ns, prompt))


def test_table_forgets_least_recently_routed_blocks_first_and_departed_replicas():
    table = PrefixTable(max_blocks_per_replica=3)
    a, b = block_chain(list(range(12)), B), block_chain(list(range(100, 112)), B)  # 3 blocks each
    table.insert("r0", a)
    table.insert("r0", a[:1])  # a's first block is now the most recent
    table.insert("r0", b[:2])  # evicts a's 2nd and 3rd blocks (least recent), not its 1st
    assert table.num_blocks("r0") == 3
    assert table.match(a, ["r0"]) == {"r0": 1} and table.match(b, ["r0"]) == {"r0": 2}
    table.insert("r1", a)
    table.remove("r0")
    assert table.match(b, ["r0", "r1"]) == {"r0": 0, "r1": 0} and table.match(a, ["r1"]) == {"r1": 3}
    assert all(holders == {"r1"} for holders in table.holders.values())


def test_pick_keeps_the_bound_and_otherwise_follows_the_longest_match():
    rng = random.Random(1)
    for _ in range(3000):
        config = RouterConfig(min_match_tokens=rng.choice([0, 4, 16]), max_imbalance=rng.randrange(4),
                              max_load_ratio=rng.choice([1.0, 1.5, 2.0]))
        replicas = [f"r{i}" for i in range(rng.randrange(1, 5))]
        loads = {r: rng.randrange(40) for r in replicas}
        matched = {r: rng.randrange(6) for r in replicas}
        chosen = pick(matched, loads, B, config, rng)
        low = min(loads.values())
        # the bound, written out: within max_imbalance of the least loaded, or within max_load_ratio times it
        bound = [r for r in replicas if loads[r] - low <= config.max_imbalance
                 or loads[r] <= low * config.max_load_ratio]
        assert chosen in bound
        longest = max(matched[r] for r in bound)
        if longest * B >= max(config.min_match_tokens, 1):
            assert matched[chosen] == longest
            assert loads[chosen] == min(loads[r] for r in bound if matched[r] == longest)
        else:
            assert loads[chosen] == low
            assert matched[chosen] == max(matched[r] for r in replicas if loads[r] == low)


def test_the_relative_bound_keeps_a_busy_replica_s_conversation_home():
    """At 30 ongoing requests, 36 is within 1.5x (the default): the match wins; at 3, a gap of 6 is not."""
    config = RouterConfig()
    assert pick({"a": 0, "b": 64}, {"a": 30, "b": 36}, B, config) == "b"
    assert pick({"a": 0, "b": 64}, {"a": 3, "b": 9}, B, config) == "a"
    assert pick({"a": 0, "b": 64}, {"a": 30, "b": 36}, B, RouterConfig(max_load_ratio=1.0)) == "a"


def test_conversations_stick_while_the_closed_loop_imbalance_stays_bounded():
    """Routing only (no request finishes): every replica stays within the bound of the least loaded (plus the
    one request that may cross it), and a conversation's next turn leaves the replica of its last turn only
    when that one is over the bound."""
    rng = random.Random(2)
    config = RouterConfig(min_match_tokens=8, max_imbalance=2, max_load_ratio=1.25)
    replicas = ["r0", "r1", "r2"]
    table, loads = PrefixTable(10**9), dict.fromkeys(replicas, 0)
    system = [rng.randrange(50) for _ in range(24)]
    history = {c: list(system) for c in range(12)}
    home: dict[int, str] = {}
    stayed = 0
    for turn in range(6):
        for c in rng.sample(sorted(history), len(history)):
            history[c] += [rng.randrange(50) for _ in range(10)]
            chain = block_chain(history[c], B)
            r = pick(table.match(chain, replicas), loads, B, config, rng)
            if turn:
                assert r == home[c] or loads[home[c]] > config.max_load(min(loads.values()))
                stayed += r == home[c]
            table.insert(r, chain)
            loads[r] += 1
            assert max(loads.values()) <= config.max_load(min(loads.values())) + 1
            home[c] = r
    assert stayed > 0 and min(loads.values()) > 0


def test_router_config_from_cluster_yaml_values():
    assert ServerConfig.from_args({}).router == RouterConfig()
    assert ServerConfig.from_args({"router": "power_of_two"}).router.policy == "power_of_two"
    assert ServerConfig.from_args({"router": {"max_imbalance": 0}}).router.max_imbalance == 0
    for bad, field in (("fastest", "router.policy"), ({"max_imbalance": -1}, "router.max_imbalance"),
                       ({"min_match_tokens": "64"}, "router.min_match_tokens"), ({"imbalance": 3}, "imbalance"),
                       ({"max_load_ratio": 0.5}, "router.max_load_ratio"), ({"max_load_ratio": "2"}, "router.max_load_ratio"),
                       ({"max_load_ratio": True}, "router.max_load_ratio"),
                       ([], "router must be")):
        with pytest.raises(ValueError, match=field):
            ServerConfig.from_args({"router": bad})
