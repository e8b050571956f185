"""Llama 3.x's JSON tool calls (`llama3_json`), against Llama 3.1 Instruct's own chat template (the public one, in
llama31_chat_template.jinja), transformers' rendering of it and the OpenAI SDK's parsing of what the server answers."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from openai import omit
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatChunk

from rayllm.protocol.chat_output import ChatOutputParser, merge_deltas, output_parser_factory
from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.sse import ChatFormat
from rayllm.protocol.tools import TOOL_FORMATS, detect_tool_format, plan_tools

LLAMA31 = (Path(__file__).parent / "llama31_chat_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}}]
MSG = [{"role": "user", "content": "Weather in Oslo?"}]
C1 = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
C2 = '{"name": "get_time", "arguments": {"tz": "CET"}}'


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS} | kw)


def plan(**kw):
    return plan_tools(request(**kw), other_constraint=False, tool_format="llama3_json")


def pieces(text: str, seed: int) -> list[str]:
    rng, out, pos = random.Random(seed), [], 0
    while pos < len(text):
        n = rng.randint(1, 5)
        out.append(text[pos:pos + n])
        pos += n
    return out


def through_the_sdk(text: str, seed: int, **kw) -> tuple[SDKChatCompletion, SDKChatCompletion]:
    """`text` as a model's output of one choice, in random pieces: (the streamed answer as the SDK's stream
    accumulator rebuilds it, the whole body), both parsed by the SDK with the request's strict tools, which
    json.loads every call's arguments."""
    req = request(stream=True, **kw)
    factory = output_parser_factory(req, plan_tools(req, other_constraint=False, tool_format="llama3_json"), "", False, False)
    state = GenerationState(1, factory)
    fmt = ChatFormat(state, request_id="r", model="m", created=1, include_usage=True)
    parts = pieces(text, seed)
    wire = ""
    for i, part in enumerate(parts):
        d = GenerationDelta(index=0, text=part, token_ids=[i], logprobs=None, matched_stop=None, prompt_tokens=3,
                            finish_reason="stop" if i == len(parts) - 1 else None, cached_tokens=0,
                            completion_tokens=i + 1)
        choice, out = state.add(d)
        wire += fmt.delta(choice, d, out)
    wire += fmt.tail()
    sdk = ChatCompletionStreamState(input_tools=TOOLS, response_format=omit)
    for event in wire.split("\n\n")[:-2]:  # the last is [DONE]
        sdk.handle_chunk(SDKChatChunk.model_validate(json.loads(event.removeprefix("data: "))))
    from openai.lib._parsing._completions import parse_chat_completion

    body = parse_chat_completion(response_format=omit, input_tools=TOOLS,
                                 chat_completion=SDKChatCompletion.model_validate(fmt.body().model_dump()))
    return sdk.get_final_completion(), body


def calls_of(completion) -> list[tuple[str, dict]]:
    return [(c.function.name, c.function.parsed_arguments) for c in completion.choices[0].message.tool_calls or []]


def test_llama_31_template_is_detected():
    assert detect_tool_format(LLAMA31) == "llama3_json"
    # Llama 3.2's template differs in leaving out <|python_tag|> and the builtin tools: its call is the same JSON.
    assert detect_tool_format(LLAMA31.replace("<|python_tag|>", "")) == "llama3_json"
    assert detect_tool_format("{{ '<tool_call>' }}{{ '\"parameters\": ' }}") == "hermes"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("text,expected", [
    (C1, [("get_weather", {"city": "Oslo"})]),
    ("<|python_tag|>" + C1, [("get_weather", {"city": "Oslo"})]),
    (f"\n{C1}; {C2}", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    (f"{C1};{C2};", [("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "CET"})]),
    ('{"name": "get_weather", "parameters": {"city": "a;b}"}}', [("get_weather", {"city": "a;b}"})]),
])
def test_calls_stream_and_parse_as_the_sdk_reads_them(seed, text, expected):
    streamed, body = through_the_sdk(text, seed)
    for completion in (streamed, body):
        assert calls_of(completion) == expected
        assert completion.choices[0].finish_reason == "tool_calls" and not completion.choices[0].message.content
    assert [c.id for c in streamed.choices[0].message.tool_calls] == [c.id for c in body.choices[0].message.tool_calls]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("text", [
    "It is 21 degrees in Oslo.",
    '{"answer": 21}',  # JSON, not a call
    '{"name": "Oslo", "population": 700000}',  # no parameters: not a call
    '{"name": "get_weather", "parameters": "{city: Oslo"}',  # arguments that are no JSON object
    "Sure: " + C1,  # a call only where the answer begins
    C1[:-9],  # cut by max_tokens
    "<|python_tag|>brave_search.call(query=\"Oslo weather\")",  # a built-in tool, not JSON
])
def test_text_that_is_not_calls_stays_content(seed, text):
    streamed, body = through_the_sdk(text, seed)
    for completion in (streamed, body):
        assert completion.choices[0].message.content == text and not completion.choices[0].message.tool_calls
        assert completion.choices[0].finish_reason == "stop"


def test_calls_before_text_that_is_no_call_stay_calls_and_the_rest_content():
    # Chunking never matters: the stream and a body fed at once decide each `;`-ended call the same way.
    whole = merge_deltas(ChatOutputParser(tools=plan()).feed(f"{C1}; not a call", final=True))
    for seed in range(4):
        _, body = through_the_sdk(f"{C1}; not a call", seed)
        assert calls_of(body) == [("get_weather", {"city": "Oslo"})] and body.choices[0].message.content == whole[
            "content"] == " not a call"


def test_parallel_tool_calls_false_keeps_the_first():
    _, body = through_the_sdk(f"{C1}; {C2}", 0, parallel_tool_calls=False)
    assert calls_of(body) == [("get_weather", {"city": "Oslo"})]


def test_what_the_template_writes_for_a_call_parses_back_to_that_call(hf_tokenizer):
    """transformers renders an assistant call with Llama 3.1's template; that text, as the model would write
    it, parses back to the same call."""
    history = [*MSG, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo, Norway"}}}]}]
    text = hf_tokenizer.apply_chat_template(history, tools=TOOLS, chat_template=LLAMA31, tokenize=False)
    assert 'Respond in the format {"name": function name, "parameters": dictionary' in text
    written = text.rsplit("<|start_header_id|>assistant<|end_header_id|>\n\n", 1)[1].removesuffix("<|eot_id|>")
    _, body = through_the_sdk(written, 1)
    assert calls_of(body) == [("get_weather", {"city": "Oslo, Norway"})]


@pytest.fixture(scope="module")
def compiler(gguf_path):
    from rayllm.sample.guided import GrammarCompiler
    from rayllm.serve.chat_template import load_tokenizer

    tok = load_tokenizer(gguf_path)
    return tok, GrammarCompiler(tok, len(tok), [0, 2])


def accepts(compiler, spec, text: str) -> bool:
    """Whether the grammar takes `text` whole and then the end of the output (token 2)."""
    from rayllm.sample.guided import new_matcher

    tok, comp = compiler
    matcher = new_matcher(comp.compile(spec))
    return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.accept_token(2)


CALL2 = '{"name": "get_time", "parameters": {"tz": "CET"}}'


@pytest.mark.parametrize("kw,good,bad", [
    ({}, [C1, f"{C1}; {CALL2}", "It is sunny."],
     [C1.replace("city", "town"), "Sure. " + C1]),
    ({"tool_choice": "required"}, [C1, f"{C1}; {CALL2}"], ["It is sunny.", C1.replace("city", "town")]),
    ({"tool_choice": "required", "parallel_tool_calls": False}, [C1], [f"{C1}; {CALL2}"]),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, [CALL2], [C1, '{"tz": "CET"}']),
])
def test_grammars_write_llamas_own_format(compiler, kw, good, bad):
    p = plan(**kw)
    for text in good:
        assert accepts(compiler, p.guided, text), text
        deltas = ChatOutputParser(tools=p).feed(text, final=True)
        if text[0] == "{":  # what the grammar lets through is what the parser reads as calls
            msg = merge_deltas(deltas)
            assert msg["content"] is None and len(msg["tool_calls"]) == text.count('{"name"'), msg
    for text in bad:
        assert not accepts(compiler, p.guided, text), text


@pytest.mark.parametrize("seed", range(3))
def test_a_named_call_streams_its_arguments_without_the_wrapping(seed):
    req = {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    streamed, body = through_the_sdk('{"name": "get_time", "parameters": {"tz": "CET"}}', seed, **req)
    for completion in (streamed, body):
        assert calls_of(completion) == [("get_time", {"tz": "CET"})]
        assert completion.choices[0].message.tool_calls[0].function.arguments == '{"tz": "CET"}'
        assert completion.choices[0].finish_reason == "stop"  # forced by name
    # Cut by max_tokens: the arguments as far as they came (OpenAI's shape for a cut call).
    p = plan(**req)
    parser = ChatOutputParser(tools=p)
    msg = merge_deltas(parser.feed('{"name": "get_time", "parameters": {"tz": "C', final=True))
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"tz": "C'


def test_formats_of_other_families_are_unchanged():
    assert set(TOOL_FORMATS) == {"hermes", "mistral", "llama3_json"}
    assert plan_tools(request(tool_choice="required"), other_constraint=False).guided.kind == "json_schema"
