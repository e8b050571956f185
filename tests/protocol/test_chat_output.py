"""The per-choice output parser: reasoning / tool-call extraction is the same however the text is chunked."""

from __future__ import annotations

import json
import random

import pytest

from rayllm.protocol.chat_output import ChatOutputParser, merge_deltas, output_parser_factory
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.tools import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSG = [{"role": "user", "content": "hi"}]


def plan(**kw):
    return plan_tools(ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS} | kw),
                      other_constraint=False)


def run(text: str, chunks: list[int], **kw) -> tuple[list[dict], ChatOutputParser]:
    parser = ChatOutputParser(**kw)
    deltas, pos = [], 0
    for n in chunks:
        deltas += parser.feed(text[pos:pos + n])
        pos += n
    deltas += parser.feed(text[pos:]) + parser.finish()
    return deltas, parser


def random_chunks(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 6) for _ in range(length)]


HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


@pytest.mark.parametrize("seed", range(5))
def test_hermes_calls_whatever_the_chunking(seed):
    deltas, parser = run(HERMES, random_chunks(seed, 40), tools=plan())
    msg = merge_deltas(deltas)
    assert msg["content"] == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in msg["tool_calls"])
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    # The first delta of each call names it; the rest only add arguments.
    firsts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [f["index"] for f in firsts] == [0, 1] and all(f["function"]["arguments"] == "" for f in firsts)


def test_text_that_only_looks_like_a_call_stays_content():
    text = "Use <tool_call> tags like <tool_call>not json</tool_call> here. a < b"
    deltas, parser = run(text, random_chunks(1, 30), tools=plan())
    assert merge_deltas(deltas) == {"content": text} and not parser.called


def test_named_streams_arguments_and_required_parses_the_list():
    deltas, _ = run('{"city": "Oslo"}', [3, 3, 3], tools=plan(tool_choice={"type": "function",
                                                                            "function": {"name": "get_weather"}}))
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert len(deltas) > 2  # arguments arrive piece by piece
    assert json.loads(merge_deltas(deltas)["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    deltas, _ = run('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [5] * 20,
                    tools=plan(tool_choice="required"))
    assert merge_deltas(deltas)["tool_calls"][0]["function"]["name"] == "get_weather"


def legacy_plan(**kw):
    return plan_tools(ChatCompletionRequest.model_validate({"messages": MSG, "functions": [TOOLS[0]["function"]]} | kw),
                      other_constraint=False)


def test_legacy_functions_use_function_call():
    deltas, parser = run('{"city": "Oslo"}', [4, 4], tools=legacy_plan(function_call={"name": "get_weather"}))
    assert merge_deltas(deltas) == {"content": None, "function_call": {"name": "get_weather",
                                                                       "arguments": '{"city": "Oslo"}'}}
    assert parser.finish_reason("stop") == "stop"  # forced by name, as OpenAI answers it


@pytest.mark.parametrize("seed", range(3))
def test_one_call_without_parallel_tool_calls_or_with_legacy_functions(seed):
    """The model's own output with two Hermes calls: parallel_tool_calls false keeps the first call only, and so
    do the legacy functions (whose function_call holds one call; the two used to merge into one)."""
    deltas, parser = run(HERMES, random_chunks(seed, 40), tools=plan(parallel_tool_calls=False))
    msg = merge_deltas(deltas)
    assert msg["content"] == "Let me check. " and parser.finish_reason("stop") == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    deltas, parser = run(HERMES, random_chunks(seed, 40), tools=legacy_plan())
    assert merge_deltas(deltas) == {"content": "Let me check. ", "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert parser.finish_reason("stop") == "function_call"


def test_a_named_tool_choice_finishes_with_stop():
    """vLLM (serving_chat: "the same is not true for named function calls") and OpenAI answer a call forced by
    name with finish_reason "stop"; a call the model chose ends with "tool_calls"."""
    _, named = run('{"city": "Oslo"}', [5], tools=plan(tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}}))
    _, required = run('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', [9],
                      tools=plan(tool_choice="required"))
    assert named.called and named.finish_reason("stop") == "stop" and named.finish_reason("length") == "length"
    assert required.finish_reason("stop") == "tool_calls"


def test_json_nested_past_the_parsers_depth_is_text_not_a_crash():
    deep = "[" * 100_000
    deltas, parser = run(deep, [50_000], tools=plan(tool_choice="required"))
    assert merge_deltas(deltas) == {"content": deep} and not parser.called
    text = f"<tool_call>{deep}</tool_call>"
    deltas, parser = run(text, [50_000], tools=plan())
    assert merge_deltas(deltas) == {"content": text} and not parser.called


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("starts_inside", [False, True])
def test_think_split_whatever_the_chunking(seed, starts_inside):
    text = ("" if starts_inside else "<think>") + "\nTwo and two.\n</think>\n\nFour."
    deltas, _ = run(text, random_chunks(seed, 20), reasoning=True, starts_in_reasoning=starts_inside)
    assert merge_deltas(deltas) == {"content": "Four.", "reasoning_content": "\nTwo and two.\n"}


def test_no_think_tags_is_all_content_and_unclosed_is_all_reasoning():
    deltas, _ = run("<thinking is fun", [2, 2, 2], reasoning=True)
    assert merge_deltas(deltas) == {"content": "<thinking is fun"}
    deltas, _ = run("<think>cut off by max_tok", [3] * 10, reasoning=True)
    assert merge_deltas(deltas) == {"content": "", "reasoning_content": "cut off by max_tok"}


def test_reasoning_held_until_done_without_stream_reasoning():
    deltas, _ = run("<think>a b c d</think>e", [1] * 30, reasoning=True, stream_reasoning=False)
    assert [d for d in deltas if "reasoning_content" in d] == [{"reasoning": "a b c d", "reasoning_content": "a b c d"}]


def test_mistral_format_calls_run_to_the_end():
    p = plan_tools(ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS}), other_constraint=False,
                   tool_format="mistral")
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
           '{"name": "get_weather", "arguments": {"city": "Bergen"}}]'
    for seed in range(3):
        deltas, parser = run(text, random_chunks(seed, 40), tools=p)
        msg = merge_deltas(deltas)
        assert msg["content"] == "Sure." and parser.finish_reason("stop") == "tool_calls"
        assert [json.loads(c["function"]["arguments"])["city"] for c in msg["tool_calls"]] == ["Oslo", "Bergen"]


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_auto_structural_tags_compile_and_constrain(svc_tokenizer, fmt):
    from rayllm.sample.guided import GrammarCompiler, new_matcher

    p = plan_tools(ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS}), other_constraint=False,
                   tool_format=fmt)
    tok = svc_tokenizer
    compiler = GrammarCompiler(tok, len(tok), [0, 2])
    good = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'}[fmt]
    bad = good.replace("city", "town")
    for text, ok in ((good, True), (bad, False)):
        matcher = new_matcher(compiler.compile(p.guided))
        accepted = all(matcher.accept_token(t) for t in tok.encode("Let me look. " + text, add_special_tokens=False))
        assert accepted == ok


@pytest.fixture(scope="module")
def svc_tokenizer(gguf_path):
    from rayllm.serve.chat_template import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.mark.parametrize("fmt,template", [
    ("hermes", '<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{{"name": "get_weather", "arguments": {args}}}]'),
])
@pytest.mark.parametrize("args,is_call", [
    ('"{city: Paris"', False), ('"[\\"Paris\\"]"', False), ('["Paris"]', False), ("7", False),
    ('"{\\"city\\": \\"Paris\\"}"', True), ('{"city": "Paris"}', True),
])
def test_a_call_needs_arguments_that_are_a_json_object(fmt, template, args, is_call):
    """With a response format the tool grammar is off, so the model may write any arguments: only a JSON object
    (or a string holding one) makes a call, which the OpenAI SDK then parses for a strict tool."""
    from openai import omit
    from openai.lib._parsing._completions import parse_chat_completion
    from openai.types.chat import ChatCompletion

    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS,
                                                "response_format": {"type": "json_object"}})
    p = plan_tools(req, other_constraint=True, tool_format=fmt)
    assert p.mode == "auto" and p.guided is None  # the response format's grammar, not the tools'
    text = template.format(args=args)
    deltas, parser = run(text, random_chunks(2, 40), tools=p)
    message = {"role": "assistant", **merge_deltas(deltas)}
    body = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": parser.finish_reason("stop")}]}
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    parsed = parse_chat_completion(response_format=omit, input_tools=strict,
                                   chat_completion=ChatCompletion.model_validate(body)).choices[0]
    if is_call:
        assert [c.function.parsed_arguments for c in parsed.message.tool_calls] == [{"city": "Paris"}]
        assert parsed.finish_reason == "tool_calls"
    else:
        assert parsed.message.content == text and not parsed.message.tool_calls and parsed.finish_reason == "stop"


# A DeepSeek-R1-distill style prompt: the template opens the thought for the model.
OPENS_THINK = "<｜User｜>Describe Bob as JSON<｜Assistant｜><think>\n"


@pytest.mark.parametrize("constrained", [False, True])
def test_a_grammar_shapes_the_answer_even_when_the_prompt_opens_think(constrained):
    """The grammar applies from the first token, so under a constraint the output is the answer (content, tool
    calls); without one, a prompt that opens <think> leaves the model inside its thought."""
    body = '{"name": "Bob", "age": 30}'
    req = ChatCompletionRequest.model_validate({"messages": MSG})
    factory = output_parser_factory(req, None, OPENS_THINK, True, constrained)
    parser = factory()
    msg = merge_deltas(parser.feed(body) + parser.finish())
    assert msg == ({"content": body} if constrained else {"content": "", "reasoning_content": body})


def test_a_required_tool_call_survives_a_prompt_that_opens_think():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": TOOLS, "tool_choice": "required"})
    required = plan_tools(req, other_constraint=False)
    assert required is not None and required.guided is not None  # the call list is a grammar
    parser = output_parser_factory(req, required, OPENS_THINK, True, True)()
    msg = merge_deltas(parser.feed('[{"name": "get_weather", "arguments": {"city": "Paris"}}]') + parser.finish())
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert msg["content"] is None and parser.finish_reason("stop") == "tool_calls"
