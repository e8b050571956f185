"""Request parsing, validation and the unsupported table: no Ray, no model (conversion: test_protocol_conversion.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rayllm.protocol.errors import APIError, from_validation_error
from rayllm.protocol.protocol import (
    IGNORED,
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    stop_options,
    to_sampling_params,
    truncate_prompt,
)
from rayllm.protocol.structured import guided_spec
from rayllm.protocol.tools import plan_tools

MSG = [{"role": "user", "content": "hi"}]
SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | kw)


def outcome(model: type, body: dict[str, Any]) -> APIError | None:
    """What the server would answer: None when accepted, else the APIError (parse, support, conversion)."""
    try:
        req = model.model_validate(body)
        check_supported(req)
        to_sampling_params(req, prompt_len=10, max_model_len=100)
        stop_options(req)
        guided = guided_spec(req)
        if isinstance(req, ChatCompletionRequest):
            plan_tools(req, other_constraint=guided is not None)
    except ValidationError as exc:
        return from_validation_error(exc)
    except APIError as exc:
        return exc
    return None


def chat_error(**kw: Any) -> APIError:
    err = outcome(ChatCompletionRequest, {"model": "m", "messages": MSG} | kw)
    assert err is not None, f"{kw} was accepted"
    assert err.status_code == 400 and set(err.to_dict()["error"]) == {"message", "type", "param", "code"}
    return err


def completion_error(**kw: Any) -> APIError:
    err = outcome(CompletionRequest, {"model": "m", "prompt": "hi"} | kw)
    assert err is not None, f"{kw} was accepted"
    assert err.status_code == 400
    return err


# ---- validation ranges ----------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [
    ("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 2.5),
    ("n", 0), ("n", 129), ("top_logprobs", 21), ("max_tokens", 0), ("max_completion_tokens", 0),
    ("min_tokens", -1), ("stop", ["a", "b", "c", "d", "e"]), ("logit_bias", {"x": 1}),
    ("logit_bias", {"-1": 1}), ("logit_bias", {"5": 101}), ("stop_regex", "(unclosed"),
    ("stop_token_ids", [-1]), ("reasoning_effort", "extreme"), ("messages", []),
])
def test_out_of_range_values_are_400s_naming_the_field(field, value):
    err = chat_error(**{field: value} | ({"logprobs": True} if field == "top_logprobs" else {}))
    assert err.param is not None and err.param.split(".")[0] == field
    assert err.message.startswith(field)


def test_range_message_is_readable():
    err = chat_error(temperature=3)
    assert err.message == "temperature: Input should be less than or equal to 2"
    assert err.param == "temperature" and err.type == "invalid_request_error"


@pytest.mark.parametrize("field, value", [("logprobs", 6), ("logprobs", -1), ("best_of", 0)])
def test_completion_ranges(field, value):
    assert completion_error(**{field: value}).param == field


def test_cross_field_rules_name_the_field():
    assert chat_error(top_logprobs=2).param == "top_logprobs"  # needs logprobs=true
    assert outcome(ChatCompletionRequest, {"messages": MSG, "logprobs": True, "top_logprobs": 2}) is None
    assert outcome(ChatCompletionRequest, {"messages": MSG, "top_logprobs": 0}) is None
    assert completion_error(n=3, best_of=2).param == "best_of"
    assert chat_error(max_tokens=5, min_tokens=6).param == "min_tokens"
    assert chat_error(continue_final_message=True).param == "continue_final_message"  # last turn is user's
    msgs = MSG + [{"role": "assistant", "content": "The"}]
    assert chat_error(messages=msgs, continue_final_message=True, add_generation_prompt=True).param == \
        "add_generation_prompt"
    assert chat(messages=msgs, continue_final_message=True).add_generation_prompt is False


def test_nested_errors_give_a_dotted_path():
    err = chat_error(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert err.param == "messages.0.content.0.image_url.url" and "Field required" in err.message
    assert chat_error(messages=[{"role": "wizard", "content": "x"}]).param == "messages.0.role"
    err = chat_error(messages=[{"role": "tool", "content": "42"}])  # OpenAI: a tool reply names its call
    assert err.param == "messages.0" and "tool_call_id" in err.message
    assert chat_error(stop=5).param == "stop"


def test_unknown_fields_are_400():
    err = chat_error(not_a_param=1)
    assert err.param == "not_a_param" and err.code == "unsupported_parameter"
    assert err.message == "Unrecognized request argument supplied: not_a_param"
    assert chat_error(messages=[{"role": "user", "content": "x", "colour": "red"}]).param == "messages.0.colour"
    assert completion_error(messages=MSG).param == "messages"  # a chat field on the completions route


def test_assistant_reasoning_by_either_name_reaches_the_template_by_both():
    """vLLM now names an assistant turn's thought `reasoning` (formerly reasoning_content): either is accepted."""
    for key in ("reasoning", "reasoning_content"):
        req = chat(messages=[*MSG, {"role": "assistant", "content": "4", key: "2 and 2"}, *MSG])
        turn = req.messages[1].model_dump(exclude_none=True)
        assert turn["reasoning"] == turn["reasoning_content"] == "2 and 2"


def test_from_validation_error_accepts_fastapi_error_lists():
    errors = [{"type": "less_than_equal", "loc": ("body", "temperature"), "msg": "Input should be <= 2"}]
    err = from_validation_error(errors)
    assert err.param == "temperature" and err.message == "temperature: Input should be <= 2"
    assert from_validation_error([]).status_code == 400


def test_extra_body_sent_literally_is_merged():
    req = chat(temperature=0.7, extra_body={"top_k": 50, "repetition_penalty": 1.05})
    assert req.top_k == 50 and req.repetition_penalty == 1.05 and req.temperature == 0.7
    assert chat_error(extra_body={"bogus": 1}).param == "bogus"
    assert chat_error(extra_body=[1]).code == "invalid_value"


# ---- supported, refused, ignored ------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED_SAMPLES: dict[str, Any] = {
    "custom_logit_processor": "x", "return_routed_experts": True,
    "max_dynamic_patch": 4, "min_dynamic_patch": 1, "deep_research": True, "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "use_beam_search": True, "length_penalty": 0.8,
}
WORKING_SAMPLES: dict[str, Any] = {  # structured output, tools and reasoning: parsed into a plan
    "response_format": {"type": "json_object"}, "regex": "a+", "ebnf": "root ::= 'a'",
    "json_schema": '{"type": "object"}', "guided_choice": ["a", "b"], "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_grammar": "root ::= 'a'", "tools": [TOOL], "tool_choice": "none",
    "structured_outputs": {"choice": ["a", "b"]}, "allowed_token_ids": [1, 2], "include_reasoning": False,
    "separate_reasoning": True, "stream_reasoning": False, "return_hidden_states": True, "best_of": 3,
    "suffix": "end",  # the 400 for a model without fill-in-the-middle tokens comes from the ingress
}
PARTS: dict[str, dict[str, Any]] = {
    "image_url": {"type": "image_url", "image_url": {"url": "https://x/y.png", "detail": "low"}},
    "video_url": {"type": "video_url", "video_url": {"url": "https://x/y.mp4"}},
    "audio_url": {"type": "audio_url", "audio_url": {"url": "https://x/y.wav"}},
    "input_audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    "file": {"type": "file", "file": {"file_id": "file-1"}},
}


def test_every_unsupported_entry_has_a_sample_and_a_home():
    fields = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert set(UNSUPPORTED) == set(REFUSED_SAMPLES) | set(PARTS)
    assert set(REFUSED_SAMPLES) <= fields and not set(PARTS) & fields


@pytest.mark.parametrize("field", sorted(REFUSED_SAMPLES))
def test_unsupported_parameters_are_refused_by_name(field):
    model = CompletionRequest if field in ("suffix", "best_of", "json_schema") else ChatCompletionRequest
    base = {"model": "m"} | ({"prompt": "hi"} if model is CompletionRequest else {"messages": MSG})
    err = outcome(model, base | {field: REFUSED_SAMPLES[field]})
    assert err is not None and err.status_code == 400
    assert err.param == field and f"`{field}`" in err.message and UNSUPPORTED[field] in err.message
    assert err.code == "unsupported_parameter"


@pytest.mark.parametrize("part", sorted(PARTS))
def test_multimodal_parts_parse_and_are_refused_with_their_type(part):
    content = [{"type": "text", "text": "look:"}, PARTS[part]]
    req = chat(messages=[{"role": "user", "content": content}])  # parses
    with pytest.raises(APIError) as e:
        check_supported(req)
    assert e.value.message.startswith(f"{part} content is not supported") and e.value.param == "messages.0.content"


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []},
    {"store": False}, {"modalities": ["text"]}, {"return_hidden_states": False}, {"lora_path": None},
    {"parallel_tool_calls": True}, {"return_cached_tokens_details": True},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
])
def test_default_or_harmless_values_of_refused_fields_pass(kw):
    assert outcome(ChatCompletionRequest, {"model": "m", "messages": MSG} | kw) is None


def test_best_of_equal_to_n_is_accepted():
    assert outcome(CompletionRequest, {"prompt": "x", "best_of": 2, "n": 2}) is None


def test_ignored_parameters_are_accepted():
    values = {"user": "u", "safety_identifier": "h",
              "verbosity": "low", "prompt_cache_key": "k", "request_id": "r",
              "rid": "r"}
    assert set(values) == set(IGNORED)
    assert outcome(ChatCompletionRequest, {"messages": MSG} | values) is None


# ---- the seed pages: every parameter parses, then works or is refused by name -----------------

SEED_000_CHAT = {  # SGLang chat page (names from its descriptions)
    "messages", "model", "max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n",
    "seed", "stop", "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "response_format", "regex", "ebnf", "tools", "tool_choice", "logprobs", "top_logprobs", "logit_bias",
    "stream", "stream_options", "max_dynamic_patch", "min_dynamic_patch", "reasoning_effort",
    "separate_reasoning", "stream_reasoning", "ignore_eos", "skip_special_tokens", "no_stop_trim",
    "stop_regex", "min_tokens", "continue_final_message", "lora_path", "chat_template_kwargs",
    "custom_logit_processor", "return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
}
SEED_001_COMPLETIONS = {  # SGLang completions page
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
    "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty", "response_format",
    "json_schema", "regex", "ebnf", "stream", "stream_options", "echo", "logprobs", "logit_bias", "best_of",
    "suffix", "ignore_eos", "skip_special_tokens", "no_stop_trim", "stop_regex", "min_tokens", "lora_path",
    "return_hidden_states", "return_routed_experts", "return_cached_tokens_details",
}
SEED_002_CHAT = {
    "chat_template_kwargs", "conversation", "deep_research", "enable_thinking", "frequency_penalty",
    "function_call", "functions", "guided_choice", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "messages", "metadata", "model", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "reasoning_effort", "repetition_penalty", "response_format", "safety_identifier", "seed", "service_tier",
    "stop", "store", "store_reasoning", "stream", "stream_options", "temperature", "tool_choice", "tools",
    "top_k", "top_logprobs", "top_p", "user", "verbosity",
}
SEED_004_CHAT = {
    "model", "messages", "temperature", "top_p", "top_k", "min_p", "n", "max_tokens", "max_completion_tokens",
    "min_tokens", "stop", "stream", "stream_options", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "top_logprobs", "logit_bias", "seed", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "user", "metadata", "extra_body",
}
SAMPLE: dict[str, dict[str, Any]] = {  # a valid, non-default value for every seed parameter (+ what it needs)
    "messages": {"messages": MSG + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]},
    "model": {"model": "m"}, "max_completion_tokens": {"max_completion_tokens": 5}, "max_tokens": {"max_tokens": 5},
    "temperature": {"temperature": 0.5}, "top_p": {"top_p": 0.9}, "top_k": {"top_k": 40}, "min_p": {"min_p": 0.1},
    "n": {"n": 2}, "seed": {"seed": 7}, "stop": {"stop": ["\n\n"]}, "stop_token_ids": {"stop_token_ids": [2]},
    "frequency_penalty": {"frequency_penalty": 0.5}, "presence_penalty": {"presence_penalty": -0.5},
    "repetition_penalty": {"repetition_penalty": 1.1}, "logprobs": {"logprobs": True},
    "top_logprobs": {"logprobs": True, "top_logprobs": 3}, "logit_bias": {"logit_bias": {"1639": 6}},
    "stream": {"stream": True}, "stream_options": {"stream": True, "stream_options": {"include_usage": True,
                                                                                      "continuous_usage_stats": True}},
    "reasoning_effort": {"reasoning_effort": "low"}, "enable_thinking": {"enable_thinking": False},
    "ignore_eos": {"ignore_eos": True}, "skip_special_tokens": {"skip_special_tokens": False},
    "no_stop_trim": {"no_stop_trim": True}, "stop_regex": {"stop_regex": [r"\d+\."]},
    "min_tokens": {"min_tokens": 2},
    "continue_final_message": {"continue_final_message": True,
                               "messages": MSG + [{"role": "assistant", "content": "The"}]},
    "chat_template_kwargs": {"chat_template_kwargs": {"enable_thinking": False}},
    "return_cached_tokens_details": {"return_cached_tokens_details": True}, "metadata": {"metadata": {"k": "v"}},
    "parallel_tool_calls": {"parallel_tool_calls": False}, "safety_identifier": {"safety_identifier": "h"},
    "service_tier": {"service_tier": "priority"}, "user": {"user": "u"}, "verbosity": {"verbosity": "high"},
    "extra_body": {"extra_body": {"top_k": 50, "repetition_penalty": 1.05}}, "prompt": {"prompt": ["a", "b"]},
    "echo": {"echo": True}, "functions": {"functions": [{"name": "f", "parameters": {}}]},
    "function_call": {"function_call": "none"},
    "store": {"store": True}, "store_reasoning": {"store": True, "store_reasoning": True},
    "conversation": {"conversation": {"id": "conv_1"}},
    "lora_path": {"lora_path": "/adapters/a"},  # accepted by the protocol; the ingress resolves the adapter
} | {name: {name: value} for name, value in (REFUSED_SAMPLES | WORKING_SAMPLES).items()} | {
    "logprobs_completion": {"logprobs": 2}}


def _seed_names(text: str) -> set[str]:
    names = set(re.findall(r"^\W*Name\s*\n\s*([a-z_]+)\s*$", text, flags=re.M))  # 004
    return names | set(re.findall(r"^([a-z_]+)\?", text, flags=re.M))  # 002


@pytest.mark.skipif(not SEEDS.exists(), reason="shared/seeds is not beside the checkout")
def test_seed_lists_match_the_pages():
    assert _seed_names(next(SEEDS.glob("002_*.txt")).read_text()) == SEED_002_CHAT
    assert _seed_names(next(SEEDS.glob("004_*.txt")).read_text()) == SEED_004_CHAT
    for f, names in (("000", SEED_000_CHAT), ("001", SEED_001_COMPLETIONS)):  # pages describe, not name
        text = next(SEEDS.glob(f"{f}_*.txt")).read_text()
        assert "Return detailed cache hit information." in text and "return_cached_tokens_details" in names


@pytest.mark.parametrize("route, name", sorted(
    [("chat", n) for n in SEED_000_CHAT | SEED_002_CHAT | SEED_004_CHAT]
    + [("completions", n) for n in SEED_001_COMPLETIONS]))
def test_every_seed_parameter_parses_then_works_or_is_refused_by_name(route, name):
    model = ChatCompletionRequest if route == "chat" else CompletionRequest
    assert name in model.model_fields or name == "extra_body"
    sample = SAMPLE["logprobs_completion" if (route, name) == ("completions", "logprobs") else name]
    base = {"model": "m"} | ({"messages": MSG} if route == "chat" else {"prompt": "hi"})
    err = outcome(model, base | sample)
    if name in UNSUPPORTED:
        assert err is not None and err.param == name, err
    else:
        assert err is None, err.to_dict() if err else None


def test_prompt_lists_and_tokenize_fields_are_bounded():
    """Completions take at most MAX_PROMPTS prompts (a token-id list is one prompt, whatever its length);
    /tokenize bounds its messages and template kwargs as chat does. Each breach names its field."""
    from rayllm.protocol import limits as L
    from rayllm.protocol.request_models import TokenizeRequest

    CompletionRequest(model="m", prompt=[1] * (L.MAX_PROMPTS + 1))  # one long prompt of token ids
    CompletionRequest(model="m", prompt=["x"] * L.MAX_PROMPTS)
    for prompt in (["x"] * (L.MAX_PROMPTS + 1), [[1]] * (L.MAX_PROMPTS + 1)):
        with pytest.raises(ValidationError) as exc:
            CompletionRequest(model="m", prompt=prompt)
        assert from_validation_error(exc.value).param == "prompt"
    msg = {"role": "user", "content": "x"}
    for kw, param in (({"messages": [msg] * (L.MAX_MESSAGES + 1)}, "messages"),
                      ({"messages": [msg], "chat_template_kwargs": {"k": "v" * L.MAX_TEMPLATE_KWARGS_BYTES}},
                       "chat_template_kwargs")):
        with pytest.raises(ValidationError) as exc:
            TokenizeRequest(**kw)
        assert from_validation_error(exc.value).param == param


@pytest.mark.parametrize(("keep", "want"), [(None, 10), (3, 3), (10, 10), (64, 10), (-1, 10)])
def test_truncate_prompt_keeps_the_last_tokens(keep, want):
    ids = list(range(10))
    assert truncate_prompt(ids, keep, max_model_len=64) == ids[len(ids) - want :]


def test_truncate_prompt_to_the_context_and_its_bounds():
    assert truncate_prompt(list(range(100)), -1, max_model_len=64) == list(range(36, 100))
    for keep in (0, 65):
        with pytest.raises(APIError) as e:
            truncate_prompt([1, 2], keep, max_model_len=64)
        assert e.value.status_code == 400 and e.value.param == "truncate_prompt_tokens"
    with pytest.raises(ValidationError):  # below -1: the request model refuses it
        CompletionRequest(prompt="x", truncate_prompt_tokens=-2)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("structured", "legacy"), [
    ({"json": SCHEMA}, {"guided_json": SCHEMA}),
    ({"regex": "(yes|no)"}, {"guided_regex": "(yes|no)"}),
    ({"choice": ["red", "green"]}, {"guided_choice": ["red", "green"]}),
    ({"grammar": 'root ::= "a"'}, {"guided_grammar": 'root ::= "a"'}),
    ({"json_object": True}, {"response_format": {"type": "json_object"}}),
])
def test_structured_outputs_constrain_as_the_guided_fields_do(structured, legacy):
    """vLLM's structured_outputs (its spelling since 0.11) compiles to what the older guided_* field does."""
    new = guided_spec(ChatCompletionRequest(model="m", messages=MSG, structured_outputs=structured))
    old = guided_spec(ChatCompletionRequest(model="m", messages=MSG, **legacy))
    assert (new.kind, new.value) == (old.kind, old.value) and new.param.startswith("structured_outputs.")


def test_structured_outputs_bounds_and_refusals():
    assert chat_error(structured_outputs={}).param == "structured_outputs"  # no constraint
    assert chat_error(structured_outputs={"regex": "a", "choice": ["b"]}).param == "structured_outputs.choice"
    assert chat_error(structured_outputs={"json": {"type": "nonsense"}}).param == "structured_outputs.json"
    assert chat_error(structured_outputs={"choice": ["a"]}, guided_regex="b").param == "structured_outputs.choice"
    assert chat_error(structured_outputs={"whitespace_pattern": " "}).param.startswith("structured_outputs")
    assert chat_error(use_beam_search=True).param == "use_beam_search"
    assert completion_error(length_penalty=0.5).param == "length_penalty"
    assert outcome(CompletionRequest, {"model": "m", "prompt": "hi", "length_penalty": 1.0}) is None
    assert chat_error(allowed_token_ids=[]).param == "allowed_token_ids"


def test_allowed_token_ids_reach_the_sampling_params():
    req = ChatCompletionRequest(model="m", messages=MSG, allowed_token_ids=[9, 3, 9])
    assert to_sampling_params(req, prompt_len=10, max_model_len=100).allowed_token_ids == (3, 9)


def test_bad_word_ids_pick_vllms_variants():
    """Each word as written, plus its leading-space form when that is a different word of as many tokens."""
    from rayllm.protocol.protocol import bad_word_ids, bad_word_variants

    assert bad_word_variants(["  Paris", "New York"]) == ["Paris", " Paris", "New York", " New York"]
    encoded = [[10], [20],  # "Paris" / " Paris": another single token -> both
               [30, 31], [40]]  # "New York" / " New York": another length -> the written form only
    assert bad_word_ids(encoded) == ((10,), (20,), (30, 31))
    assert bad_word_ids([[5, 6], [5, 6]]) == ((5, 6),)  # the same first token: one entry
    assert bad_word_ids([[], [7]]) == ()  # whitespace only bans nothing
