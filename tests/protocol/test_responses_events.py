"""Engine deltas -> Response output items and semantic events.

References: the OpenAI SDK's own types (every event and the final body validate as its pydantic
models) and its stream accumulator (ResponseStreamState, what `client.responses.stream` runs), which
must rebuild from the events exactly the Response that ResponseAssembler.final() returns.
"""

from __future__ import annotations

import json
import random

import pydantic
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from rayllm.protocol.chat_output import ChatOutputParser
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.responses_api import ResponseCreate
from rayllm.protocol.responses_events import ResponseAssembler, skeleton, sse
from rayllm.protocol.tools import plan_tools

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def deltas(pieces: list[str], finish: str = "stop", prompt: int = 10, cached: int = 4) -> list[GenerationDelta]:
    out = []
    for i, text in enumerate(pieces):
        last = i == len(pieces) - 1
        out.append(GenerationDelta(index=0, text=text, token_ids=[i], logprobs=None,
                                   finish_reason=finish if last else None, matched_stop=None, prompt_tokens=prompt,
                                   cached_tokens=cached, completion_tokens=i + 1))
    return out


def run(pieces: list[str], parser: ChatOutputParser | None = None, finish: str = "stop",
        **body) -> tuple[list[dict], dict]:
    req = ResponseCreate.model_validate({"input": "x"} | body)
    asm = ResponseAssembler(skeleton(req, "resp_1", "m", None))
    state = GenerationState(1, (lambda: parser) if parser is not None else None)  # the choice's parser
    events = asm.start()
    for d in deltas(pieces, finish):
        _, parsed = state.add(d)
        events += asm.feed(d, parsed)
    events += asm.finish()
    events.append(asm.done_event())
    return events, asm.final()


def _unparsed(value):
    """The SDK's accumulator adds its own `parsed` / `parsed_arguments` fields: not part of the wire body."""
    if isinstance(value, dict):
        return {k: _unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    return [_unparsed(v) for v in value] if isinstance(value, list) else value


def check_with_sdk(events: list[dict], final: dict) -> Response:
    """Every event parses as the SDK's type, in sequence; its accumulator rebuilds the final body."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        wire = json.loads(sse(e).split("data: ", 1)[1])  # what the client reads
        state.handle_event(EVENT.validate_python(wire))
    body = Response.model_validate(final)
    if final["status"] == "completed":
        rebuilt = state._completed_response
        assert rebuilt.id == body.id and rebuilt.usage == body.usage and rebuilt.output_text == body.output_text
        assert [_unparsed(o.to_dict()) for o in rebuilt.output] == [o.to_dict() for o in body.output]
    return body


def test_text_stream_order_and_final_body():
    events, final = run(["Hel", "lo", " world"])
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 3 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    body = check_with_sdk(events, final)
    assert body.output_text == "Hello world" == events[-4]["text"]
    assert body.status == "completed" and body.output[0].status == "completed"
    assert body.usage.input_tokens == 10 and body.usage.input_tokens_details.cached_tokens == 4
    assert body.usage.output_tokens == 3 and body.usage.total_tokens == 13
    assert events[0]["response"]["output"] == [] and events[0]["response"]["status"] == "in_progress"


def test_length_makes_an_incomplete_response():
    events, final = run(["a", "b"], finish="length", max_output_tokens=2)
    body = check_with_sdk(events, final)
    assert events[-1]["type"] == "response.incomplete"
    assert body.status == "incomplete" and body.incomplete_details.reason == "max_output_tokens"
    assert body.output[0].status == "incomplete" and body.completed_at is None


def test_empty_output_is_still_one_message():
    events, final = run([""])
    body = check_with_sdk(events, final)
    assert [o.type for o in body.output] == ["message"] and body.output_text == ""


def test_reasoning_item_then_message():
    parser = ChatOutputParser(reasoning=True)
    events, final = run(["<think>Let me ", "think.", "</think>\n\nThe answer", " is 4."], parser)
    body = check_with_sdk(events, final)
    assert [o.type for o in body.output] == ["reasoning", "message"]
    assert body.output[0].content[0].text == "Let me think."
    assert body.output_text == "The answer is 4."
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_item.added", 3)
    assert body.usage.output_tokens_details.reasoning_tokens == 2  # the two deltas that only thought


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_function_call_items(choice):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                 "tool_choice": choice})
    parser = ChatOutputParser(tools=plan_tools(chat, other_constraint=False))
    args = '{"city": "Paris"}'
    text = json.dumps([{"name": "get_weather", "arguments": json.loads(args)}]) if choice == "required" else args
    events, final = run([text[:5], text[5:]], parser)
    body = check_with_sdk(events, final)
    assert [o.type for o in body.output] == ["function_call"]
    call = body.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and json.loads(call.arguments) == \
        json.loads(args)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0]["arguments"] == call.arguments
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") \
        == call.arguments


def test_logprobs_reach_the_text_part():
    req = ResponseCreate.model_validate({"input": "x"})
    asm = ResponseAssembler(skeleton(req, "resp_1", "m", None))
    lp = [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    d = GenerationDelta(index=0, text="Hi", token_ids=[1], logprobs=lp, finish_reason="stop", matched_stop=None,
                        prompt_tokens=1, cached_tokens=0, completion_tokens=1)
    events = asm.start() + asm.feed(d, None) + asm.finish() + [asm.done_event()]
    check_with_sdk(events, asm.final())
    assert [e for e in events if e["type"] == "response.output_text.delta"][0]["logprobs"] == lp
    assert asm.final()["output"][0]["content"][0]["logprobs"] == lp


def test_error_events_after_the_stream_began():
    req = ResponseCreate.model_validate({"input": "x"})
    asm = ResponseAssembler(skeleton(req, "resp_1", "m", None))
    events = asm.start() + asm.feed(deltas(["partial"], finish=None)[0], None) + asm.error_events(RuntimeError("boom"))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    for e in events:
        EVENT.validate_python(e)
    assert events[-1]["response"]["status"] == "failed" and "RuntimeError" in events[-2]["message"]


def test_a_response_that_failed_after_it_was_made_carries_its_output():
    """A storage failure comes after the last item was done: response.failed carries the output and usage the
    events built (the SDK's stream helper passes a failed response's own output on, and rebuilds it from the
    events only when there is none), so "it is in the response.failed event" holds."""
    req = ResponseCreate.model_validate({"input": "x"})
    asm = ResponseAssembler(skeleton(req, "resp_1", "m", None))
    events = asm.start()
    for d in deltas(["Hel", "lo"]):
        events += asm.feed(d, None)
    events += asm.finish()
    events += asm.error_events(APIError(503, "could not be stored", type="server_error", code="storage_unavailable"))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    seen = [ev for e in events for ev in state.handle_event(EVENT.validate_python(json.loads(sse(e).split("data: ", 1)[1])))]
    failed = seen[-1].response
    assert seen[-1].type == "response.failed" and failed.status == "failed"
    assert failed.error.code == "server_error" and seen[-2].code == "storage_unavailable"  # OpenAI's codes; ours
    built = [state._completed_output[i].to_dict() for i in sorted(state._completed_output)]
    assert [o.to_dict() for o in failed.output] == built and failed.output[0].content[0].text == "Hello"
    assert failed.usage.output_tokens == 2 and failed.usage.input_tokens == 10


def test_an_aborted_generation_is_a_failed_response_with_its_error():
    """An abort (e.g. the request's LoRA adapter unloaded mid-generation) ends with response.failed, status
    "failed" and an error, as OpenAI reports a response that did not finish; the SDK's stream helper then has no
    completed response to give (its get_final_response raises)."""
    events, final = run(["Hel", "lo"], finish="abort")
    body = check_with_sdk(events, final)
    assert events[-1]["type"] == "response.failed" and events[-1]["response"] == final
    assert body.status == "failed" and body.error.code == "server_error" and "aborted" in body.error.message
    assert body.incomplete_details is None and body.completed_at is None
    assert body.output[0].status == "incomplete" and body.output_text == "Hello"
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(EVENT.validate_python(e))
    assert state._completed_response is None
    length, _ = run(["a"], finish="length")
    assert length[-1]["type"] == "response.incomplete"  # a length cut is still incomplete


EOS = "<|im_end|>"
# (token, part of the answer's text): a thought, the answer, a tool call, then the end-of-sequence token.
TOKENS = [("<think>", False), ("Let", False), (" me", False), (" see", False), (".", False), ("</think>", False),
          ("\n\n", False), ("The", True), (" answer", True), (" is", True), (" 4", True), (".", True),
          ("<tool_call>", False), ('\n{"name": "get_weather", ', False), ('"arguments": {"city": "Oslo"}}', False),
          ("\n</tool_call>", False), (EOS, False)]


def coalesced(tokens: list[tuple[str, bool]], rng: random.Random) -> list[GenerationDelta]:
    """The tokens in deltas of one to three (as the engine client merges them), some with their text held back
    to the next delta (as the detokenizer holds an unfinished character); the EOS token has no text."""
    out, i, held = [], 0, ""
    while i < len(tokens):
        group = tokens[i:i + rng.randint(1, 3)]
        i += len(group)
        text = held + "".join(t for t, _ in group if t != EOS)
        last = i == len(tokens)
        held, text = (text, "") if rng.random() < 0.3 and not last else ("", text)
        out.append(GenerationDelta(index=0, text=text, token_ids=list(range(len(group))), logprobs=[
            {"token": t, "logprob": -0.1 * k, "bytes": list(t.encode()), "top_logprobs": []}
            for k, (t, _) in enumerate(group)],
            finish_reason="stop" if last else None, matched_stop=None, prompt_tokens=3, cached_tokens=0,
            completion_tokens=i))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_call", [True, False])
def test_output_text_logprobs_are_the_answer_tokens_only(seed, with_call):
    """Reasoning tokens (think tags too) and a tool call's tokens are not the text's: output_text.logprobs hold the
    answer's own tokens, however the tokens were batched into deltas; an EOS right after the answer goes with it."""
    tokens = TOKENS if with_call else [t for t in TOKENS if not t[0].startswith(("<tool", "\n{", '"arg', "\n</"))]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    parser = ChatOutputParser(reasoning=True, tools=plan_tools(chat, other_constraint=False))
    req = ResponseCreate.model_validate({"input": "x"})
    asm = ResponseAssembler(skeleton(req, "resp_1", "m", None))
    state = GenerationState(1, lambda: parser)
    events = asm.start()
    for d in coalesced(tokens, random.Random(seed)):
        _, parsed = state.add(d)
        events += asm.feed(d, parsed)
    events += asm.finish() + [asm.done_event()]
    body = check_with_sdk(events, asm.final())
    kinds = [o.type for o in body.output]
    assert kinds == (["reasoning", "message", "function_call"] if with_call else ["reasoning", "message"])
    text = body.output[1].content[0]
    assert text.text == "The answer is 4."
    want = [t for t, answer in tokens if answer] + ([] if with_call else [EOS])
    assert [lp.token for lp in text.logprobs] == want
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done[0]["logprobs"]] == want
