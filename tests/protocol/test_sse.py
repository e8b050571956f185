"""Stream chunk sequencing and non-stream assembly, checked against our models and the OpenAI SDK's types.

The formats are driven by the ingress's real stream loop (rayllm.serve.generation_stream), fed batches of one
delta each as the model deployment would stream them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types import Completion as SDKCompletion
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatChunk

from rayllm.protocol.choice_state import GenerationState, ParserFactory
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from rayllm.protocol.sse import SSE_DONE, ChatFormat, CompletionFormat, OpenAIFormat, sse_event
from rayllm.serve.generation_stream import Generation
from rayllm.serve.metrics import ServerMetrics

KW: dict[str, Any] = dict(request_id="r1", model="m", created=1)


def delta(index: int, text: str, done: str | None = None, n_tok: int = 1, prompt_tokens: int = 5,
          **kw: Any) -> GenerationDelta:
    return GenerationDelta(index=index, text=text, token_ids=[1], logprobs=kw.pop("logprobs", None),
                           finish_reason=done, matched_stop=kw.pop("matched_stop", None),
                           prompt_tokens=prompt_tokens, cached_tokens=2, completion_tokens=n_tok, **kw)


def lp(tok: str, val: float | None, top: int = 1) -> dict:
    alts = [{"token": tok, "logprob": val, "bytes": list(tok.encode())}] * top if val is not None else []
    return {"token": tok, "logprob": val, "bytes": list(tok.encode()), "top_logprobs": alts}


async def batches(items: list) -> Any:
    for item in items:
        if isinstance(item, BaseException):
            raise item
        yield [item]


def generation(cls: type[OpenAIFormat], items: list, n: int = 1, parser_factory: ParserFactory | None = None,
               **kw: Any) -> Generation:
    state = GenerationState(n, parser_factory, legacy_logprobs=cls is CompletionFormat)
    return Generation(batches(items), cls(state, **KW, **kw), metrics=ServerMetrics(), model="m", t0=0.0,
                      timeout_s=None, retry_after_s=1.0)


async def stream(cls: type[OpenAIFormat], items: list, **kw: Any) -> list[str]:
    """The SSE body's events, one string each (the loop writes each batch's events as one string)."""
    gen = generation(cls, items, **kw)
    await gen.start()
    body = "".join([e async for e in gen.events()])
    return [e + "\n\n" for e in body.split("\n\n")[:-1]]


async def collect(cls: type[OpenAIFormat], items: list, **kw: Any) -> Any:
    return await generation(cls, items, **kw).body()


def chunks(out: list[str]) -> list[dict]:
    assert out[-1] == SSE_DONE and all(e.startswith("data: ") and e.endswith("\n\n") for e in out)
    return [json.loads(e[6:]) for e in out[:-1]]


# ---- formatting -----------------------------------------------------------------------------


def test_sse_event_formats():
    assert sse_event({"a": None, "b": "é"}) == 'data: {"a":null,"b":"é"}\n\n'
    chunk = ChatCompletionChunk(id="x", created=1, model="m", choices=[])
    assert sse_event(chunk) == 'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[]}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


# ---- chat streams ---------------------------------------------------------------------------


async def test_chat_stream_order_and_usage():
    items = [delta(0, "Hel"), delta(0, "", n_tok=2), delta(0, "lo", n_tok=3), delta(0, "", "stop", n_tok=4,
                                                                                  matched_stop=2)]
    out = chunks(await stream(ChatFormat, items, n=1, include_usage=True))
    for c in out:
        ChatCompletionChunk.model_validate(c)
        SDKChatChunk.model_validate(c)
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in out[1:3]] == [{"content": "Hel"}, {"content": "lo"}]  # "" skipped
    assert out[3]["choices"][0]["finish_reason"] == "stop" and out[3]["choices"][0]["matched_stop"] == 2
    assert all("usage" not in c for c in out[:-1])
    assert out[-1]["choices"] == [] and out[-1]["object"] == "chat.completion.chunk" and out[-1]["id"] == "r1"
    assert out[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 2}}


async def test_chat_stream_without_usage_ends_with_the_finish_chunk():
    out = chunks(await stream(ChatFormat, [delta(0, "a", "length")]))
    assert [c["choices"][0]["finish_reason"] for c in out] == [None, "length"]


async def test_chat_stream_n_choices_each_open_with_the_role_and_usage_counts_the_prompt_once():
    items = [delta(0, "a"), delta(1, "b"), delta(1, "c", "stop", n_tok=2), delta(0, "d", "length", n_tok=2)]
    out = chunks(await stream(ChatFormat, items, n=2, include_usage=True, continuous_usage_stats=True))
    roles = [c["choices"][0]["index"] for c in out if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    assert all("usage" in c for c in out)  # continuous_usage_stats
    assert out[-1]["usage"]["prompt_tokens"] == 5 and out[-1]["usage"]["completion_tokens"] == 4
    assert out[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    text = {i: "".join(c["choices"][0]["delta"].get("content", "") for c in out
                       if c["choices"] and c["choices"][0]["index"] == i) for i in (0, 1)}
    assert text == {0: "ad", 1: "bc"}


async def test_chat_stream_logprobs_ride_on_their_chunk():
    items = [delta(0, "", logprobs=[lp("\xe2", -0.1)]), delta(0, "é", "stop", logprobs=[lp("\xa9", -0.2)])]
    out = chunks(await stream(ChatFormat, items))
    assert [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in out[1:]] == [-0.1, -0.2]
    for c in out:
        SDKChatChunk.model_validate(c)


@pytest.mark.parametrize("fmt", [ChatFormat, CompletionFormat])
async def test_error_mid_stream_is_an_event_then_done(fmt):
    out = await stream(fmt, [delta(0, "a"), APIError(400, "boom", param="max_tokens")])
    assert json.loads(out[-2][6:])["error"] == {"message": "boom", "type": "invalid_request_error",
                                                "param": "max_tokens", "code": None}
    assert out[-1] == SSE_DONE
    out = await stream(fmt, [delta(0, "a"), RuntimeError("secret detail")])
    err = json.loads(out[-2][6:])["error"]
    assert err["type"] == "server_error" and "RuntimeError" in err["message"] and "secret" not in err["message"]
    assert out[-1] == SSE_DONE


# ---- completions streams --------------------------------------------------------------------


async def test_completion_stream_echo_first_and_usage_over_prompts():
    # two prompts x n=2: choices 0,1 share prompt 0 (5 tokens), choices 2,3 share prompt 1 (7 tokens)
    items = [delta(0, "hi", prompt_text="P: "), delta(2, "yo", prompt_tokens=7, prompt_text="Q: "),
             delta(1, "x", "stop", prompt_text="P: "), delta(3, "z", "length", prompt_tokens=7, prompt_text="Q: "),
             delta(0, "!", "stop", n_tok=2), delta(2, "", "stop", n_tok=1, prompt_tokens=7)]
    out = chunks(await stream(CompletionFormat, items, n=2, include_usage=True))
    for c in out:  # (the SDK's Completion type wants a finish_reason, so it cannot check chunks)
        CompletionChunk.model_validate(c)
    assert out[0]["choices"][0] == {"index": 0, "text": "P: hi", "logprobs": None, "finish_reason": None}
    assert out[0]["object"] == "text_completion"
    texts: dict[int, str] = {}
    for c in out[:-1]:
        texts[c["choices"][0]["index"]] = texts.get(c["choices"][0]["index"], "") + c["choices"][0]["text"]
    assert texts == {0: "P: hi!", 1: "P: x", 2: "Q: yo", 3: "Q: z"}
    assert out[-1]["choices"] == [] and out[-1]["usage"]["prompt_tokens"] == 12
    assert out[-1]["usage"]["completion_tokens"] == 2 + 1 + 1 + 1
    assert out[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


async def test_completion_stream_legacy_logprobs_offsets_continue_across_chunks():
    first = delta(0, "b", prompt_text="a", prompt_logprobs=[None], logprobs=[lp("b", -0.5)])
    items = [first, delta(0, "cd", logprobs=[lp("c", -1.0), lp("d", -2.0)]), delta(0, "", "stop")]
    out = chunks(await stream(CompletionFormat, items))
    assert out[0]["choices"][0]["text"] == "ab"
    assert out[0]["choices"][0]["logprobs"] == {"tokens": ["", "b"], "token_logprobs": [None, -0.5],
                                                "top_logprobs": [None, {"b": -0.5}], "text_offset": [0, 1]}
    assert out[1]["choices"][0]["logprobs"]["text_offset"] == [2, 3]
    assert out[2]["choices"][0]["finish_reason"] == "stop" and out[2]["choices"][0]["logprobs"] is None


# ---- non-stream assembly --------------------------------------------------------------------


async def test_collect_chat_concatenates_and_sums_usage_over_choices():
    items = [delta(0, "a", logprobs=[lp("a", -0.1, top=2)]), delta(1, "b"), delta(1, "c", "length", n_tok=2),
             delta(0, "d", "stop", n_tok=2, matched_stop="\n", logprobs=[lp("d", -0.2)])]
    body = await collect(ChatFormat, items, n=2)
    assert isinstance(body, ChatCompletionResponse)
    data = body.model_dump()
    SDKChatCompletion.model_validate(data)
    assert data["id"] == "r1" and data["object"] == "chat.completion" and data["system_fingerprint"] is None
    assert [c["message"] for c in data["choices"]] == [{"role": "assistant", "content": "ad"},
                                                       {"role": "assistant", "content": "bc"}]
    assert [(c["finish_reason"], c["matched_stop"]) for c in data["choices"]] == [("stop", "\n"), ("length", None)]
    assert [t["token"] for t in data["choices"][0]["logprobs"]["content"]] == ["a", "d"]
    assert len(data["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert data["choices"][1]["logprobs"] is None
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    compact = json.loads(body.model_dump_json(exclude_none=True))
    assert "logprobs" not in compact["choices"][1] and compact["choices"][0]["message"]["content"] == "ad"


async def test_collect_completion_echo_and_legacy_logprobs_offsets():
    first = delta(0, " x", prompt_text="ab", prompt_logprobs=[lp("a", None), lp("b", -0.5)],
                  logprobs=[lp(" x", -1.0)])
    items = [first, delta(0, "yz", logprobs=[lp("y", -0.3), lp("z", -0.4)]), delta(0, "", "stop", n_tok=3)]
    body = await collect(CompletionFormat, items, n=1)
    assert isinstance(body, CompletionResponse)
    data = body.model_dump()  # (the SDK types the echo's leading null as float, so it cannot check this one)
    c = data["choices"][0]
    assert c["text"] == "ab xyz" and c["finish_reason"] == "stop"
    assert c["logprobs"] == {"tokens": ["a", "b", " x", "y", "z"],
                             "token_logprobs": [None, -0.5, -1.0, -0.3, -0.4],
                             "top_logprobs": [None, {"b": -0.5}, {" x": -1.0}, {"y": -0.3}, {"z": -0.4}],
                             "text_offset": [0, 1, 2, 4, 5]}
    assert all(c["text"][o:].startswith(t) for t, o in zip(c["logprobs"]["tokens"], c["logprobs"]["text_offset"],
                                                           strict=True))
    assert data["usage"]["completion_tokens"] == 3 and data["object"] == "text_completion"


async def test_collect_completion_without_echo_or_logprobs():
    items = [delta(0, "a", prompt_text=None), delta(1, "b", "stop"), delta(0, "c", "length", n_tok=2)]
    data = (await collect(CompletionFormat, items, n=2)).model_dump()
    SDKCompletion.model_validate(data)
    assert [(c["text"], c["logprobs"], c["finish_reason"]) for c in data["choices"]] == [
        ("ac", None, "length"), ("b", None, "stop")]
    assert data["usage"]["total_tokens"] == 5 + 3


async def test_collect_propagates_errors():
    with pytest.raises(APIError):
        await collect(ChatFormat, [delta(0, "a"), APIError(400, "boom")])


# ---- other routes' bodies -------------------------------------------------------------------


def test_tokenize_response_shape():
    assert TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2]).model_dump() == {
        "count": 2, "max_model_len": 8, "tokens": [1, 2]}


def test_model_list_shape():
    card = ModelCard(id="smol", created=1, root="smol", max_model_len=2048)
    assert ModelList(data=[card]).model_dump() == {"object": "list", "data": [{
        "id": "smol", "object": "model", "created": 1, "owned_by": "rayllm-tp", "root": "smol", "parent": None,
        "max_model_len": 2048}]}
