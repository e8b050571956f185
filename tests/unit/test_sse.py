"""Stream chunk sequencing and non-stream assembly."""

from __future__ import annotations

import json

from app.errors import APIError
from app.sse import GenerationDelta, collect_chat, collect_completion, stream_chat, stream_completion

KW = dict(request_id="r1", model="m", created=1)


def delta(index, text, done=None, n_tok=1, **kw) -> GenerationDelta:
    return GenerationDelta(index=index, text=text, token_ids=[1], logprobs=None, finish_reason=done,
                           matched_stop=None, prompt_tokens=5, cached_tokens=2, completion_tokens=n_tok, **kw)


async def agen(items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


async def events(gen) -> list:
    return [e async for e in gen]


async def test_chat_stream_order_and_usage():
    items = [delta(0, "Hel"), delta(0, "lo", n_tok=2), delta(0, "", "stop", n_tok=3)]
    out = await events(stream_chat(agen(items), n=1, include_usage=True, **KW))
    assert out[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[6:]) for e in out[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 2}}


async def test_error_mid_stream_is_an_event_then_done():
    out = await events(stream_chat(agen([delta(0, "a"), APIError(400, "boom")]), n=1, **KW))
    assert json.loads(out[-2][6:])["error"]["message"] == "boom"
    assert out[-1] == "data: [DONE]\n\n"


async def test_collect_chat_sums_usage_over_choices():
    items = [delta(0, "a"), delta(1, "b"), delta(1, "c", "length", n_tok=2), delta(0, "d", "stop", n_tok=2)]
    body = await collect_chat(agen(items), n=2, **KW)
    assert [c["message"]["content"] for c in body["choices"]] == ["ad", "bc"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == 5


def lp(tok: str, val: float) -> dict:
    return {"token": tok, "logprob": val, "bytes": list(tok.encode()), "top_logprobs": [{"token": tok, "logprob": val,
                                                                                        "bytes": []}]}


async def test_completion_echo_and_legacy_logprobs_offsets():
    first = delta(0, " x", prompt_text="ab", prompt_logprobs=[{"token": "a", "logprob": None, "bytes": [97], "top_logprobs": []}, lp("b", -0.5)])
    first.logprobs = [lp(" x", -1.0)]
    body = await collect_completion(agen([first, delta(0, "", "stop")]), n=1, **KW)
    c = body["choices"][0]
    assert c["text"] == "ab x"
    assert c["logprobs"]["tokens"] == ["a", "b", " x"]
    assert c["logprobs"]["token_logprobs"] == [None, -0.5, -1.0]
    assert c["logprobs"]["text_offset"] == [0, 1, 2]
    out = await events(stream_completion(agen([delta(0, "hi", prompt_text="P: "), delta(0, "", "stop")]), n=1, **KW))
    assert json.loads(out[0][6:])["choices"][0]["text"] == "P: hi"
