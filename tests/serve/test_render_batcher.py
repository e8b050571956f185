"""The ingress's chat renders (rayllm/serve/render_batcher.py) on the session's real Serve app, over the tokenizer
replica's direct channel and coalesced into batch calls through the handle: each request still gets exactly
the ids of transformers' apply_chat_template."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

CONVERSATIONS = [
    [{"role": "user", "content": f"Question {i}: what is {i} + {i}? " + "Explain. " * (i % 7)}] if i % 3 else
    [{"role": "system", "content": f"Persona {i}."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ça va? 東京 🎉 " * i}]
    for i in range(24)
]
# continue_final_message needs an assistant turn last: a client error for this request only.
BAD = ([{"role": "user", "content": "Hi"}], {"add_generation_prompt": False, "continue_final_message": True})


def reference_ids(hf_tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                            return_dict=False)


def batcher_of(model_name: str, direct: bool):
    from ray import serve

    from rayllm.serve.render_batcher import RenderBatcher
    from rayllm.serve.routes.model_routes import ModelTokenizer

    return RenderBatcher(ModelTokenizer(serve.get_deployment_handle("tokenizer", app_name="llm"), model_name),
                         direct=direct)


def test_direct_channel_renders_equal_apply_chat_template(server, model_name, hf_tokenizer):
    batcher = batcher_of(model_name, direct=True)

    async def main() -> list:
        assert await batcher.channel() is not None  # the tokenizer replica runs on this node
        calls = [batcher.render(m) for m in CONVERSATIONS] + [batcher.render(BAD[0], **BAD[1])]
        return await asyncio.gather(*calls, return_exceptions=True)

    *out, bad = asyncio.run(main())
    assert isinstance(bad, ValueError) and "assistant" in str(bad)
    for i, (messages, (text, ids)) in enumerate(zip(CONVERSATIONS, out, strict=True)):
        assert ids == reference_ids(hf_tokenizer, messages), i
        assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert batcher.calls == 0  # none went through the handle


def test_concurrent_renders_coalesce_and_each_equals_apply_chat_template(server, model_name, hf_tokenizer):
    batcher = batcher_of(model_name, direct=False)

    async def main() -> list:
        calls = [batcher.render(m) for m in CONVERSATIONS[:12]] + [batcher.render(BAD[0], **BAD[1])]
        calls += [batcher.render(m, add_generation_prompt=False) for m in CONVERSATIONS[12:]]
        cancelled = asyncio.ensure_future(batcher.render(CONVERSATIONS[0]))  # gives up while queued
        await asyncio.sleep(0)
        cancelled.cancel()
        return await asyncio.gather(*calls, return_exceptions=True)

    out = asyncio.run(main())
    # All were queued in one tick: the first sender took them in one call (two at most, max_in_flight 2).
    assert 1 <= batcher.calls <= 2
    assert isinstance(out[12], ValueError) and "assistant" in str(out[12])
    results = out[:12] + out[13:]
    for i, (messages, (text, ids)) in enumerate(zip(CONVERSATIONS, results, strict=True)):
        add = i < 12
        assert ids == reference_ids(hf_tokenizer, messages, add), i
        assert text == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
    # One at a time (nothing to coalesce): one call each, the same ids.
    before = batcher.calls
    for messages in CONVERSATIONS[:3]:
        assert asyncio.run(batcher.render(messages))[1] == reference_ids(hf_tokenizer, messages)
    assert batcher.calls == before + 3


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_concurrent_http_requests_render_through_the_batcher(server, model_name, hf_tokenizer, route):
    """The ingress's own render path: concurrent requests, one of them a client error (400, its own)."""

    async def main() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120) as http:
            extra = {} if route == "/tokenize" else {"max_tokens": 1}  # /tokenize takes no sampling fields
            bodies = [{"model": model_name, "messages": m, **extra} for m in CONVERSATIONS[:8]]
            bodies.append({"model": model_name, "messages": BAD[0], **extra, **BAD[1]})
            return await asyncio.gather(*(http.post(route, json=b) for b in bodies))

    *ok, bad = asyncio.run(main())
    assert bad.status_code == 400 and "assistant" in bad.json()["error"]["message"], bad.text
    for messages, r in zip(CONVERSATIONS, ok, strict=False):
        assert r.status_code == 200, r.text
        expected = reference_ids(hf_tokenizer, messages)
        if route == "/tokenize":
            assert r.json()["tokens"] == expected
        else:
            assert r.json()["usage"]["prompt_tokens"] == len(expected)


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _InProcess:
    """The tokenizer replica's own class called in this process (what its handle would reach): no Ray here."""

    def __init__(self, deployment, model: str):
        self.model = model
        self.render_chat_batch = _Method(lambda calls: deployment.render_chat_batch(model, calls))
        self.render_endpoint = _Method(lambda: deployment.render_endpoint(model))


def test_large_renders_do_not_hold_the_small_ones_back(gguf_path, hf_tokenizer):
    """Two large renders in flight (the batcher's two slots) and small ones after them: the small ones are
    answered first, each one transformers' ids."""
    from rayllm.serve.render_batcher import RenderBatcher
    from rayllm.serve.tokenizer import TokenizerDeployment

    deployment = TokenizerDeployment.func_or_class({"m": gguf_path})  # the replica's class, without Serve
    batcher = RenderBatcher(_InProcess(deployment, "m"), direct=False)
    big = [{"role": "user", "content": "Ça va? 東京 🎉 " * 60_000}]  # ~1 MB: 60 times LARGE_INPUT, a render of ~1 s
    done: list[str] = []

    async def render(name: str, messages: list[dict]) -> tuple:
        result = await batcher.render(messages)
        done.append(name)
        return result

    async def main() -> list:
        larges = []
        for i in range(2):  # one after the other: two calls, one in each slot
            larges.append(asyncio.ensure_future(render(f"large{i}", big)))
            await asyncio.sleep(0.01)
        smalls = [render(f"small{i}", m) for i, m in enumerate(CONVERSATIONS[:4])]
        return await asyncio.gather(*larges, *smalls)

    try:
        out = asyncio.run(main())
    finally:
        deployment.channel.close()
    assert set(done[:4]) == {"small0", "small1", "small2", "small3"}, done
    assert out[0][1] == reference_ids(hf_tokenizer, big)
    for messages, (_, ids) in zip(CONVERSATIONS, out[2:], strict=False):
        assert ids == reference_ids(hf_tokenizer, messages)
