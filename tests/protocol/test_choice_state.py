"""rayllm.protocol.choice_state: one state per choice, fed once per delta; the stream and the whole body written from it
agree, as the OpenAI SDK's own stream accumulator rebuilds them."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatChunk

from rayllm.protocol.chat_output import ChatOutputParser, merge_deltas, output_parser_factory
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.sse import SSE_DONE, ChatFormat
from rayllm.protocol.tools import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
PLAIN = "It is sunny in Oslo today, or so they say."


def chat_request() -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                 "stream": True})


def pieces_of(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), 6))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def interleaved(texts: dict[int, str], rng: random.Random, prompt_tokens: int = 9) -> list[GenerationDelta]:
    """Each choice's text in random pieces (one token each), the choices' deltas interleaved."""
    queues = {i: pieces_of(t, rng) for i, t in texts.items()}
    counts = dict.fromkeys(texts, 0)
    out: list[GenerationDelta] = []
    while any(queues.values()):
        # Choice 0 first: the SDK's accumulator takes the first chunk's choice index as a list position.
        i = rng.choice([k for k, q in queues.items() if q]) if out else 0
        counts[i] += 1
        text = queues[i].pop(0)
        out.append(GenerationDelta(index=i, text=text, token_ids=[counts[i]], logprobs=None,
                                   finish_reason=None if queues[i] else "stop", matched_stop=None,
                                   prompt_tokens=prompt_tokens, cached_tokens=3, completion_tokens=counts[i]))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_stream_and_body_agree_through_the_sdk_accumulator(seed):
    req = chat_request()
    factory = output_parser_factory(req, plan_tools(req, other_constraint=False), "", False, False)
    deltas = interleaved({0: CALL, 1: PLAIN}, random.Random(seed))
    state = GenerationState(2, factory)
    fmt = ChatFormat(state, request_id="r", model="m", created=1, include_usage=True)
    wire = ""
    for d in deltas:
        choice, pieces = state.add(d)
        wire += fmt.delta(choice, d, pieces)
    wire += fmt.tail()
    events = [e + "\n\n" for e in wire.split("\n\n")[:-1]]
    assert events[-1] == SSE_DONE
    sdk = ChatCompletionStreamState(input_tools=omit, response_format=omit)
    for e in events[:-1]:
        sdk.handle_chunk(SDKChatChunk.model_validate(json.loads(e.removeprefix("data: "))))
    streamed = sdk.get_final_completion()
    body = SDKChatCompletion.model_validate(fmt.body().model_dump())
    assert streamed.usage == body.usage and body.usage.prompt_tokens == 9  # one prompt, n=2
    for s, b in zip(sorted(streamed.choices, key=lambda c: c.index), body.choices, strict=True):
        assert s.finish_reason == b.finish_reason
        assert (s.message.content or None) == (b.message.content or None)
        assert [(c.id, c.function.name, c.function.arguments) for c in s.message.tool_calls or []] == \
            [(c.id, c.function.name, c.function.arguments) for c in b.message.tool_calls or []]
    call, plain = body.choices
    assert call.finish_reason == "tool_calls" and json.loads(call.message.tool_calls[0].function.arguments) == {
        "city": "Oslo"}
    assert plain.finish_reason == "stop" and plain.message.content == PLAIN


def test_one_parser_per_choice_fed_once_matches_parsing_the_whole_text():
    made: list[ChatOutputParser] = []

    def factory() -> ChatOutputParser:
        made.append(ChatOutputParser(reasoning=True))
        return made[-1]

    text = "<think>Two and two.</think>\n\nFour."
    state = GenerationState(1, factory)
    for d in interleaved({0: text}, random.Random(7)):
        state.add(d)
    (choice,) = state.sorted_choices()
    assert len(made) == 1
    whole = merge_deltas(ChatOutputParser(reasoning=True).feed(text, final=True))  # what a body used to parse
    assert choice.message() == whole == {"content": "Four.", "reasoning_content": "Two and two."}
    assert choice.text == text and choice.completion_tokens == 7 and choice.reason() == "stop"


def delta(index: int, text: str, finish: str | None = None, **kw: Any) -> GenerationDelta:
    fields: dict[str, Any] = dict(token_ids=[1], logprobs=None, matched_stop=None, prompt_tokens=5,
                                  cached_tokens=1, completion_tokens=1)
    return GenerationDelta(index=index, text=text, finish_reason=finish, **(fields | kw))


def test_usage_counts_each_prompt_once_and_completeness():
    state = GenerationState(n=2)  # two prompts x n=2: choices 0, 1 share prompt 0; 2, 3 prompt 1
    for d in [delta(0, "a"), delta(1, "b"), delta(2, "c", prompt_tokens=7), delta(3, "d", prompt_tokens=7),
              delta(0, "e", "length", completion_tokens=2), delta(1, "", "stop")]:
        state.add(d)
    assert state.usage() == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert not state.complete()  # choices 2 and 3 never finished
    state.add(delta(2, "", "stop"))
    state.add(delta(3, "", "abort"))
    assert not state.complete() and state.outcome() == "abort"
    assert [c.text for c in state.sorted_choices()] == ["ae", "b", "c", "d"]


def test_completion_offsets_and_legacy_logprobs_follow_the_text():
    def lp(tok: str) -> dict:
        return {"token": tok, "logprob": -1.0, "top_logprobs": []}

    state = GenerationState(legacy_logprobs=True)
    state.add(delta(0, "b", prompt_text="echo ", prompt_logprobs=[None, lp("echo"), lp(" ")], logprobs=[lp("b")]))
    choice, _ = state.add(delta(0, "cd", logprobs=[lp("c"), lp("d")]))
    assert choice.offset == len("echo b") and choice.text == "echo bcd"
    legacy = choice.legacy.to_dict()
    assert legacy["tokens"] == ["", "echo", " ", "b", "c", "d"]
    assert all(choice.text[o:].startswith(t) for t, o in zip(legacy["tokens"], legacy["text_offset"], strict=True))


def test_cached_tokens_are_one_figure_per_prompt_whatever_order_its_choices_end_in():
    """A later choice finds the prompt its sibling computed (all of it cached): the request reports the least any
    choice of the prompt found, whichever finished last."""
    for order in ([0, 1], [1, 0]):
        state = GenerationState(n=2)
        for i in order:
            state.add(delta(i, "a", "stop", cached_tokens=(16, 96)[i], prompt_tokens=100))
        assert state.usage()["prompt_tokens_details"] == {"cached_tokens": 16}


def test_legacy_top_logprobs_always_hold_the_chosen_token():
    """OpenAI and vLLM: each position's top_logprobs has the token chosen (so `logprobs: 0` gives it alone); the
    first echoed prompt token, without a logprob, has none."""
    def lp(tok: str, value: float | None, *alts: tuple[str, float]) -> dict:
        return {"token": tok, "logprob": value, "top_logprobs": [{"token": t, "logprob": v} for t, v in alts]}

    state = GenerationState(legacy_logprobs=True)
    choice, _ = state.add(delta(0, "bc", prompt_text="a", prompt_logprobs=[lp("a", None)],
                                logprobs=[lp("b", -3.0), lp("c", -2.0, ("x", -0.1), ("c", -2.0))]))
    legacy = choice.legacy.to_dict()
    assert legacy["top_logprobs"] == [None, {"b": -3.0}, {"c": -2.0, "x": -0.1}]


def test_reasoning_goes_by_both_names_streamed_and_whole():
    """vLLM now names the thought `reasoning`, SGLang and older clients read `reasoning_content`: the SDK's stream
    chunks and whole message carry both, the same text."""
    state = GenerationState(1, lambda: ChatOutputParser(reasoning=True))
    fmt = ChatFormat(state, request_id="r", model="m", created=1)
    wire = ""
    for d in interleaved({0: "<think>Two and two.</think>\n\nFour."}, random.Random(3)):
        choice, pieces = state.add(d)
        wire += fmt.delta(choice, d, pieces)
    chunks = [SDKChatChunk.model_validate(json.loads(e.removeprefix("data: "))) for e in wire.split("\n\n")[:-1]]
    thought = [c.choices[0].delta.model_extra for c in chunks if c.choices[0].delta.model_extra]
    assert thought and all(x["reasoning"] == x["reasoning_content"] for x in thought)
    assert "".join(x["reasoning"] for x in thought) == "Two and two."
    message = SDKChatCompletion.model_validate(fmt.body().model_dump()).choices[0].message
    assert message.model_extra == {"reasoning": "Two and two.", "reasoning_content": "Two and two."}
    assert message.content == "Four."
