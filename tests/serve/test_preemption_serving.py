"""Preemption and chunked prefill through the server: an app whose KV cache holds a few hundred tokens and
whose step budget is smaller than the prompts, so concurrent long requests are prefilled in chunks and
preempted (and recomputed); every answer still equals the same request's answer alone (`batch_invariant`,
so greedy equality is exact). The app serves the tiny Llama of conftest.tiny_models (RANDOM weights, SmolLM2's
tokenizer): what is compared is the token sequence a greedy request gets alone and under preemption, which does
not depend on the weights being trained, and its steps cost a small part of the real model's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve.conftest import API_KEY
from tests.serve.ops_apps import deploy

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

BLOCK = 16
NUM_BLOCKS = 40  # 640 tokens of KV: four requests of ~300 tokens each cannot all stay resident
MODEL = "tiny-llama"  # the served name of the app's model
ENGINE = {"model": {"served_model_name": MODEL, "dtype": "float32", "max_model_len": 512},
          "cache": {"block_size": BLOCK, "num_blocks_override": NUM_BLOCKS, "enable_prefix_caching": False},
          "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "batch_invariant": True}}
TOPICS = ["rivers", "mountains", "the moon", "bread", "trains", "owls"]


def long_prompt(topic: str) -> str:
    """~250 tokens: four 64-token prefill chunks at the app's step budget."""
    facts = " ".join(f"Fact {i}: {topic} are often discussed in story number {i}." for i in range(18))
    return f"{facts}\nNow write one long paragraph about {topic}:"


@pytest.fixture(scope="module")
def tiny(server, apps, tiny_models):
    from ray import serve

    apps.append("tiny")
    engine = ENGINE | {"model": ENGINE["model"] | {"model": tiny_models["tiny-llama"]}}
    base = deploy(server, "tiny", {"api_keys": [API_KEY], "engine": engine})
    handle = serve.get_deployment_handle("llm", app_name="tiny")
    return base, lambda: handle.stats.remote().result()


MAX_TOKENS = 40


def ask(base: str, topic: str, stream: bool = False) -> tuple[str, int]:
    """One long request's answer and prompt length (greedy, ignoring EOS: always MAX_TOKENS tokens)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    kw = {"model": MODEL, "prompt": long_prompt(topic), "max_tokens": MAX_TOKENS, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.usage.prompt_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.prompt_tokens


@pytest.fixture(scope="module")
def solo(tiny) -> dict[str, tuple[str, int]]:
    """Each topic's answer alone, one request at a time: what every answer under preemption must equal."""
    base, _ = tiny
    return {t: ask(base, t) for t in TOPICS}


def test_concurrent_long_requests_are_preempted_and_still_equal_their_solo_answers(tiny, solo):
    base, stats = tiny
    for _, prompt_tokens in solo.values():
        assert prompt_tokens > 3 * ENGINE["scheduler"]["max_num_batched_tokens"]  # chunked prefill
        assert prompt_tokens + MAX_TOKENS <= NUM_BLOCKS * BLOCK
    assert sum(p + MAX_TOKENS for _, p in solo.values()) > 2 * NUM_BLOCKS * BLOCK  # together they cannot fit
    before = stats()["num_preemptions"]
    with ThreadPoolExecutor(len(TOPICS)) as pool:
        together = dict(zip(TOPICS, pool.map(lambda t: ask(base, t), TOPICS), strict=True))
    assert stats()["num_preemptions"] > before, "the cache should have forced preemption"
    assert together == solo


def test_streamed_answers_under_preemption_equal_the_solo_answers(tiny, solo):
    """Streams that get preempted resume where they were: no token is repeated or lost in the SSE stream."""
    base, _ = tiny
    topics = TOPICS[:4]
    with ThreadPoolExecutor(len(topics)) as pool:
        streamed = dict(zip(topics, pool.map(lambda t: ask(base, t, stream=True), topics), strict=True))
    assert streamed == {t: solo[t] for t in topics}
