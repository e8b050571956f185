"""Request parsing, validation and conversion: no Ray, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.errors import APIError, from_validation_error
from app.protocol import (
    IGNORED,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    completion_prompts,
    stop_options,
    to_sampling_params,
)

MSG = [{"role": "user", "content": "hi"}]
SEEDS = Path(__file__).resolve().parents[3] / "shared" / "seeds"


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def api_error(**kw) -> APIError:
    try:
        req = chat(**kw)
        check_supported(req)
        to_sampling_params(req, prompt_len=10, max_model_len=100)
        stop_options(req)
    except ValidationError as exc:
        return from_validation_error(exc.errors())
    except APIError as exc:
        return exc
    raise AssertionError(f"{kw} was accepted")


@pytest.mark.parametrize("field, value", [
    ("temperature", 2.5), ("top_p", 0), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("n", 0), ("top_logprobs", 21),
    ("max_tokens", 0), ("stop", ["a", "b", "c", "d", "e"]), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}), ("stop_regex", "(unclosed"),
])
def test_out_of_range_values_are_400s_naming_the_field(field, value):
    err = api_error(**{field: value})
    assert err.status_code == 400
    assert err.param == field
    assert field in err.message
    assert set(err.to_dict()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("lora_path", "/x"), ("return_routed_experts", True), ("return_hidden_states", True),
    ("custom_logit_processor", "x"), ("store", True), ("conversation", "c1"), ("guided_choice", ["a"]),
    ("regex", "a+"), ("ebnf", "root ::= 'a'"), ("separate_reasoning", True), ("tool_choice", "required"),
])
def test_unsupported_parameters_are_refused_by_name(field, value):
    err = api_error(**{field: value})
    assert err.status_code == 400 and err.param == field and field in err.message


def test_multimodal_part_refused_with_its_type():
    err = api_error(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    assert "image_url" in err.message


def test_ignored_parameters_are_accepted():
    req = chat(**{name: "x" if name != "metadata" else {"k": "v"} for name in IGNORED})
    check_supported(req)


def test_unknown_field_is_400():
    err = api_error(not_a_param=1)
    assert err.param == "not_a_param" and err.code == "unsupported_parameter"


def test_conversion_and_lengths():
    req = chat(max_tokens=50, max_completion_tokens=5, temperature=0, top_k=0, logprobs=True, top_logprobs=3,
               logit_bias={"7": 100}, stop="x", no_stop_trim=True, seed=3)
    p = to_sampling_params(req, prompt_len=10, max_model_len=100)
    assert p.max_tokens == 5 and p.greedy and p.top_k == -1 and p.logprobs == 3 and p.seed == 3
    assert p.logit_bias == ((7, 100.0),)
    assert stop_options(req).stop == ("x",) and stop_options(req).include_stop_str_in_output
    assert to_sampling_params(chat(), prompt_len=10, max_model_len=100).max_tokens == 90
    with pytest.raises(APIError) as e:
        to_sampling_params(chat(), prompt_len=100, max_model_len=100)
    assert e.value.param == "messages"
    with pytest.raises(APIError) as e:
        to_sampling_params(chat(max_tokens=91), prompt_len=10, max_model_len=100)
    assert e.value.param == "max_tokens"


def test_completion_prompts_and_echo_logprobs():
    assert completion_prompts(CompletionRequest(prompt="a")) == ["a"]
    assert completion_prompts(CompletionRequest(prompt=[1, 2])) == [[1, 2]]
    assert completion_prompts(CompletionRequest(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    assert completion_prompts(CompletionRequest(prompt=["a", "b"])) == ["a", "b"]
    with pytest.raises(APIError):
        completion_prompts(CompletionRequest(prompt=[]))
    p = to_sampling_params(CompletionRequest(prompt="a", echo=True, logprobs=2), prompt_len=3, max_model_len=50)
    assert p.logprobs == 2 and p.prompt_logprobs == 2
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="a", n=3, best_of=2)


def _seed_names(text: str) -> set[str]:
    names = set(re.findall(r"^\s*Name\s*\n\s*([a-z_]+)\s*$", text, flags=re.M))
    names |= set(re.findall(r"^([a-z_]+)\?", text, flags=re.M))
    return names


@pytest.mark.skipif(not SEEDS.exists(), reason="shared/seeds is not beside the checkout")
def test_every_seed_parameter_is_a_request_field():
    chat_fields = set(ChatCompletionRequest.model_fields)
    names = set()
    for f in sorted(SEEDS.glob("00[24]_*.txt")):
        names |= _seed_names(f.read_text())
    names -= {"extra_body"}  # the SDK merges it into the body
    assert names and names <= chat_fields, sorted(names - chat_fields)
    sglang = {"max_completion_tokens", "max_tokens", "top_k", "min_p", "stop_token_ids", "regex", "ebnf",
              "ignore_eos", "skip_special_tokens", "no_stop_trim", "stop_regex", "min_tokens",
              "continue_final_message", "lora_path", "chat_template_kwargs", "custom_logit_processor",
              "return_hidden_states", "return_routed_experts", "max_dynamic_patch", "min_dynamic_patch",
              "separate_reasoning", "stream_reasoning", "reasoning_effort", "repetition_penalty"}
    assert sglang <= chat_fields
    completion = {"prompt", "echo", "suffix", "best_of", "logprobs", "json_schema", "regex", "ebnf",
                  "ignore_eos", "no_stop_trim", "stop_regex", "min_tokens", "lora_path", "return_hidden_states",
                  "return_routed_experts", "stream_options", "logit_bias", "response_format"}
    assert completion <= set(CompletionRequest.model_fields)
