"""The prefix router through the real app (Ray Serve, two model replicas): a conversation's turns land on one
replica and reuse its prefix cache (the usage's cached_tokens), while load still spreads. The replicas serve the
tiny Llama of conftest.tiny_models (RANDOM weights, SmolLM2's tokenizer, Llama 3.1's chat template): where a request is
routed and which of its prompt blocks are cached do not depend on what the model says."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from rayllm.serve.prefix_affinity import RouterConfig
from tests.serve.ops_apps import deploy

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

BLOCK = 16  # the engine's (and so the router's) block size
SYSTEM = ("You are the support assistant of a bicycle shop. You answer questions about repairs, parts, prices and "
          "opening hours briefly and politely, and you never invent prices that you were not told about. The "
          "shop opens at nine and closes at six, repairs take two days, and customers may rent a bicycle.")
IMBALANCE = 1
MODEL = "tiny-llama"  # the served name of the app's model
# Tokens of each of the load test's requests sharing a prefix: enough that all eight are routed before any ends
# (the tiny model's steps take a few milliseconds).
LOAD_TOKENS = 256


@pytest.fixture(scope="module")
def routed(server, apps, tiny_models) -> str:
    """Two model replicas of the tiny Llama (RANDOM weights) behind the prefix router, with a tight load bound."""
    apps.append("prefix")
    engine = {"model": {"model": tiny_models["tiny-llama"], "served_model_name": MODEL, "dtype": "float32",
                        "max_model_len": 512},
              "cache": {"block_size": BLOCK, "kv_cache_bytes": 16 << 20},
              "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256}}
    return deploy(server, "prefix", {"router": {"policy": "prefix", "max_imbalance": IMBALANCE},
                                     "llm_deployment_options": {"num_replicas": 2}, "engine": engine})


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


async def turn(c: openai.AsyncOpenAI, messages: list[dict], max_tokens: int = 4) -> tuple[str, int, int]:
    """(replica, prompt tokens, cached prompt tokens) of one greedy chat request."""
    raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                            temperature=0, extra_body={"ignore_eos": True})
    usage = raw.parse().usage
    return raw.headers["x-replica-id"], usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_a_conversations_turns_stay_on_one_replica_and_hit_its_prefix_cache(routed):
    async def conversation(c: openai.AsyncOpenAI, topic: str) -> list[tuple[str, int, int]]:
        messages = [{"role": "system", "content": SYSTEM}]
        seen = []
        for i in range(3):
            messages.append({"role": "user", "content": f"Question {i} about {topic}: what should I check first?"})
            seen.append(await turn(c, messages))
            messages.append({"role": "assistant", "content": f"Check the {topic} carefully, step {i}."})
        return seen

    async def run() -> list[list[tuple[str, int, int]]]:
        c = client(routed)
        return [await conversation(c, topic) for topic in ("brakes", "chain", "tyres")]

    for turns in asyncio.run(run()):
        assert len({replica for replica, _, _ in turns}) == 1, turns
        for (_, before, _), (_, _, cached) in zip(turns, turns[1:], strict=False):
            # The previous turn's prompt is cached but for the block at its end (a token there may re-merge)
            assert cached >= (before // BLOCK - 1) * BLOCK, turns


def test_load_spreads_over_both_replicas_within_the_bound(routed):
    """Eight concurrent requests sharing a long prefix: each replica takes a share within the bound (+ 1)
    (they all are routed before any finishes: LOAD_TOKENS each, so also on a busy machine); distinct short
    prompts spread too."""
    async def run() -> tuple[list[str], list[str]]:
        c = client(routed)
        shared = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hello number {i}."}]
                  for i in range(8)]
        same = await asyncio.gather(*(turn(c, m, max_tokens=LOAD_TOKENS) for m in shared))
        short = await asyncio.gather(*(turn(c, [{"role": "user", "content": f"Hi {i}"}], max_tokens=4)
                                       for i in range(8)))
        return [r for r, _, _ in same], [r for r, _, _ in short]

    same, short = asyncio.run(run())
    counts = sorted(same.count(r) for r in set(same))
    bound = RouterConfig(max_imbalance=IMBALANCE)  # the app's router: the tight gap, the default ratio
    assert len(counts) == 2 and counts[1] <= bound.max_load(counts[0]) + 1, same
    assert len(set(short)) == 2, short


def test_metrics_count_both_replicas(routed):
    """/metrics' engine gauges combine every replica's record (rayllm.serve.metrics), not one per scrape."""
    import httpx

    from rayllm.serve.metrics import STATS_INTERVAL_S, deployment_engine_stats

    time.sleep(STATS_INTERVAL_S * 1.5)  # each replica has written since the last requests ended
    stats = deployment_engine_stats("prefix", "llm")
    assert stats is not None and stats["replicas"] == 2 and stats["num_running"] == 0, stats
    text = httpx.get(f"{routed}/metrics", timeout=30).text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}} 0.0' in text
