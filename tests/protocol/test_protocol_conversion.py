"""Conversion of parsed requests into engine inputs (sampling params, stops, prompts): no Ray, no model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rayllm.protocol import limits as L
from rayllm.protocol.errors import APIError, from_validation_error
from rayllm.protocol.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    completion_prompts,
    stop_options,
    template_kwargs,
    to_sampling_params,
)

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi"} | kw)


# ---- conversion ----------------------------------------------------------------------------


def test_conversion():
    req = chat(max_tokens=50, max_completion_tokens=5, temperature=0, top_k=0, logprobs=True, top_logprobs=3,
               logit_bias={"9": -1, "7": 100}, stop="x", no_stop_trim=True, seed=3, stop_token_ids=[4, 4, 5],
               min_p=0.05, repetition_penalty=1.2, presence_penalty=0.1, frequency_penalty=0.2, min_tokens=2)
    p = to_sampling_params(req, prompt_len=10, max_model_len=100)
    assert p.max_tokens == 5 and p.greedy and p.top_k == -1 and p.logprobs == 3 and p.seed == 3
    assert p.logit_bias == ((7, 100.0), (9, -1.0)) and p.stop_token_ids == (4, 5) and p.min_tokens == 2
    assert (p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (0.05, 1.2, 0.1, 0.2)
    assert p.prompt_logprobs is None
    assert to_sampling_params(chat(logprobs=True), prompt_len=1, max_model_len=9).logprobs == 0
    assert to_sampling_params(chat(), prompt_len=1, max_model_len=9).logprobs is None


def test_default_max_tokens_is_what_the_context_leaves():
    assert to_sampling_params(chat(), prompt_len=10, max_model_len=100).max_tokens == 90
    assert to_sampling_params(completion(), prompt_len=10, max_model_len=100).max_tokens == 90
    assert to_sampling_params(chat(min_tokens=95), prompt_len=10, max_model_len=100).min_tokens == 90
    assert to_sampling_params(chat(max_tokens=90), prompt_len=10, max_model_len=100).max_tokens == 90


def test_context_length_errors():
    with pytest.raises(APIError) as e:
        to_sampling_params(chat(), prompt_len=100, max_model_len=100)
    assert e.value.param == "messages" and e.value.code == "context_length_exceeded"
    assert "maximum context length is 100 tokens" in e.value.message and "100 input tokens" in e.value.message
    with pytest.raises(APIError) as e:
        to_sampling_params(completion(), prompt_len=120, max_model_len=100)
    assert e.value.param == "prompt"
    with pytest.raises(APIError) as e:
        to_sampling_params(chat(max_tokens=91), prompt_len=10, max_model_len=100)
    assert e.value.param == "max_tokens" and "(91 > 100 - 10)" in e.value.message
    with pytest.raises(APIError) as e:
        to_sampling_params(chat(max_tokens=1, max_completion_tokens=91), prompt_len=10, max_model_len=100)
    assert e.value.param == "max_completion_tokens"


def test_eos_token_id_joins_stop_ids_unless_ignored():
    assert to_sampling_params(chat(stop_token_ids=[3]), prompt_len=1, max_model_len=9,
                              eos_token_id=2).stop_token_ids == (3, 2)
    assert to_sampling_params(chat(stop_token_ids=[2]), prompt_len=1, max_model_len=9,
                              eos_token_id=2).stop_token_ids == (2,)
    p = to_sampling_params(chat(ignore_eos=True), prompt_len=1, max_model_len=9, eos_token_id=2)
    assert p.stop_token_ids == () and p.ignore_eos


def test_completion_logprobs_and_echo():
    p = to_sampling_params(completion(echo=True, logprobs=2), prompt_len=3, max_model_len=50)
    assert p.logprobs == 2 and p.prompt_logprobs == 2
    p = to_sampling_params(completion(logprobs=0), prompt_len=3, max_model_len=50)
    assert p.logprobs == 0 and p.prompt_logprobs is None
    assert to_sampling_params(completion(echo=True), prompt_len=3, max_model_len=50).prompt_logprobs is None


def test_stop_options():
    s = stop_options(chat(stop=["a", "", "a", "b"], stop_regex=r"\d", include_stop_str_in_output=True,
                          skip_special_tokens=False, spaces_between_special_tokens=False))
    assert s.stop == ("a", "b") and s.stop_regex == (r"\d",) and s.include_stop_str_in_output
    assert not s.skip_special_tokens and not s.spaces_between_special_tokens
    d = stop_options(completion(stop="x"))
    assert d.stop == ("x",) and not d.include_stop_str_in_output and d.skip_special_tokens
    assert stop_options(chat(no_stop_trim=True)).include_stop_str_in_output


def test_reasoning_switches_merge_into_template_kwargs():
    assert template_kwargs(chat(enable_thinking=False, reasoning_effort="high")) == {
        "enable_thinking": False, "reasoning_effort": "high"}
    kw = template_kwargs(chat(enable_thinking=True, chat_template_kwargs={"enable_thinking": False, "x": 1}))
    assert kw == {"enable_thinking": False, "x": 1}  # the explicit kwargs win
    assert template_kwargs(chat()) == {}


def test_completion_prompts():
    assert completion_prompts(completion(prompt="a")) == ["a"]
    assert completion_prompts(completion(prompt=[1, 2])) == [[1, 2]]
    assert completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    for bad in ([], [[]], ["a", ""]):
        with pytest.raises(APIError) as e:
            completion_prompts(completion(prompt=bad))
        assert e.value.param == "prompt"
    # Ids are int32 and not negative at parse (the tokenizer would overflow decoding them for echo); the 400
    # names the id and its bound, not the union's other branches.
    for bad, param, bound in (([[1], [-2]], "prompt.1.0", "greater than or equal to 0"),
                              ([-1], "prompt.0", "greater than or equal to 0"),
                              ([2**40, 5], "prompt.0", "less than or equal to 2147483647")):
        with pytest.raises(ValidationError) as v:
            completion(prompt=bad)
        err = from_validation_error(v.value)
        assert (err.status_code, err.param) == (400, param) and bound in err.message


def test_tokenize_requests():
    assert TokenizeRequest(prompt="hi").add_special_tokens
    assert TokenizeRequest.model_validate({"messages": MSG, "add_generation_prompt": False}).messages
    for body in ({}, {"prompt": "a", "messages": MSG}):
        with pytest.raises(ValidationError):
            TokenizeRequest.model_validate(body)
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=[-1])
    with pytest.raises(ValidationError) as v:  # bounded: more ids than any context holds
        DetokenizeRequest(tokens=[1] * (L.MAX_DETOKENIZE_IDS + 1))
    assert from_validation_error(v.value).param == "tokens"
    assert len(DetokenizeRequest(tokens=[1] * L.MAX_DETOKENIZE_IDS).tokens) == L.MAX_DETOKENIZE_IDS


def test_app_imports_neither_torch_nor_ray():
    code = ("import sys, rayllm.protocol.protocol, rayllm.protocol.sse, rayllm.protocol.errors; "
            "print(sorted(m for m in ('torch', 'ray', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "[]"


def test_error_types_follow_the_status_class():
    """OpenAI's error `type`: the client's for any 4xx the table does not name (405, 409, 422), the server's for 5xx."""
    assert [APIError(s, "m").type for s in (400, 401, 404, 405, 409, 422, 429, 500, 503)] == [
        "invalid_request_error", "authentication_error", "not_found_error", "invalid_request_error",
        "invalid_request_error", "invalid_request_error", "rate_limit_error", "server_error", "server_error"]
