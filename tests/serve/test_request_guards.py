"""The ingress's per-request bounds (rayllm.serve.request_guards) on real parsed requests and ServerConfig."""

from __future__ import annotations

import pytest

from rayllm.protocol import protocol as P
from rayllm.protocol.errors import APIError
from rayllm.serve.config import ServerConfig
from rayllm.serve.request_guards import check_request, check_sampling

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(messages=MSG, **kw)


def completion(**kw) -> P.CompletionRequest:
    return P.CompletionRequest(prompt="hi", **kw)


def refusal(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status_code == 400
    return info.value


def test_sequences_are_prompts_times_n_or_best_of():
    cfg = ServerConfig(max_sequences_per_request=16)
    assert check_request(cfg, completion(n=4), 4) == 16
    assert check_request(cfg, completion(n=2, best_of=8), 2) == 16
    err = refusal(check_request, cfg, completion(n=2), 9)
    assert (err.param, err.code) == ("prompt", "too_many_sequences") and "max_sequences_per_request" in err.message
    assert refusal(check_request, cfg, completion(n=2, best_of=17), 1).param == "best_of"
    assert refusal(check_request, cfg, chat(n=17), 1).param == "n"
    assert check_request(ServerConfig(max_sequences_per_request=0), completion(n=128), 500) == 64000


def test_requested_tokens_count_the_default_max_tokens():
    cfg = ServerConfig(max_requested_tokens=1000)
    check_sampling(cfg, chat(max_tokens=100), 10, 100, 50)
    err = refusal(check_sampling, cfg, chat(max_tokens=101), 10, 101, 50)
    assert (err.param, err.code) == ("max_tokens", "too_many_requested_tokens")
    err = refusal(check_sampling, cfg, chat(), 10, 2000, 50)  # no max_tokens: what the context leaves
    assert "default" in err.message
    assert refusal(check_sampling, cfg, chat(max_completion_tokens=200), 10, 200, 50).param == "max_completion_tokens"


def test_hidden_states_are_bounded_per_request():
    cfg = ServerConfig()
    check_sampling(cfg, chat(max_tokens=1024, return_hidden_states=True), 4, 1024, 50)
    err = refusal(check_sampling, cfg, chat(max_tokens=1025, return_hidden_states=True), 4, 1025, 50)
    assert err.param == "return_hidden_states" and "max_tokens 1025" in err.message
    err = refusal(check_sampling, cfg, chat(return_hidden_states=True), 1, 8000, 50)  # the default: the context's rest
    assert err.param == "return_hidden_states"
    check_sampling(cfg, chat(), 1, 8000, 50)  # without it, only max_requested_tokens applies


def test_token_ids_must_be_in_the_vocabulary():
    cfg = ServerConfig()
    assert refusal(check_sampling, cfg, chat(logit_bias={"50": 1}), 1, 4, 50).param == "logit_bias"
    assert refusal(check_sampling, cfg, chat(stop_token_ids=[50]), 1, 4, 50).param == "stop_token_ids"
    assert refusal(check_sampling, cfg, completion(), 1, 4, 50, [[1, 50]]).param == "prompt"
    check_sampling(cfg, chat(logit_bias={"49": 1}, stop_token_ids=[49]), 1, 4, 50, [[0, 49]])


def test_request_chat_template_needs_the_switch():
    err = refusal(check_request, ServerConfig(), chat(chat_template="{{ messages }}"), 1)
    assert (err.param, err.code) == ("chat_template", "chat_template_not_allowed")
    assert check_request(ServerConfig(allow_request_chat_template=True), chat(chat_template="{{ messages }}"), 1) == 1


def test_config_refuses_negative_bounds():
    with pytest.raises(ValueError, match="max_sequences_per_request"):
        ServerConfig(max_sequences_per_request=-1)
    assert ServerConfig().max_request_bytes == 8 << 20  # bounded by default


def test_scored_literal_choices_count_as_sequences():
    """Literal choices are scored one engine sequence a prompt and choice: those count against
    max_sequences_per_request (400 naming the constraint); past MAX_SCORED_SEQUENCES the replica samples them
    under their grammar (prompts x n), as scoring_fits decides on the same requests."""
    from rayllm.protocol.io_struct import GenerateRequest, StopOptions
    from rayllm.protocol.structured import guided_spec, literal_choices
    from rayllm.schema.sampling_params import SamplingParams
    from rayllm.serve.generation_modes import MAX_SCORED_SEQUENCES, scoring_fits

    def both(cfg: ServerConfig, req: P.CompletionRequest, prompts: int) -> tuple[int, bool]:
        guided = guided_spec(req)
        seqs = check_request(cfg, req, prompts, guided)
        engine = GenerateRequest("r", [[1, 2]] * prompts, SamplingParams(), StopOptions(), n=req.n or 1, guided=guided)
        return seqs, scoring_fits(engine, literal_choices(guided))

    cfg = ServerConfig(max_sequences_per_request=16)
    words = [f"w{i}" for i in range(20)]
    assert both(cfg, completion(structured_outputs={"choice": words[:16]}), 1) == (1, True)
    err = refusal(check_request, cfg, completion(structured_outputs={"choice": words}), 1,
                  guided_spec(completion(structured_outputs={"choice": words})))
    assert (err.param, err.code) == ("structured_outputs.choice", "too_many_sequences") and "20 choices" in err.message
    assert refusal(check_request, cfg, completion(guided_choice=words[:9]), 2,
                   guided_spec(completion(guided_choice=words[:9]))).param == "guided_choice"
    regex = completion(regex="|".join(words))  # a plain alternation is a literal choice list too
    assert refusal(check_request, cfg, regex, 1, guided_spec(regex)).param == "regex"
    # The reviewer's request: 64 prompts x 256 choices is sampled under the grammar, 64 sequences.
    big = completion(structured_outputs={"choice": [f"choice{i}" for i in range(256)]})
    assert 64 * 256 > MAX_SCORED_SEQUENCES
    assert both(ServerConfig(), big, 64) == (64, False)
    assert both(ServerConfig(max_sequences_per_request=0), completion(guided_choice=words), 3) == (3, True)


def test_scoring_leaves_requests_with_other_controls_to_the_grammar():
    """Scoring reads the model's raw logprobs: a request with controls it would ignore is sampled under the
    grammar, which applies them; a long choice list counts its own tokens in the scoring budget."""
    from dataclasses import replace

    from rayllm.protocol.io_struct import GenerateRequest, StopOptions
    from rayllm.schema.sampling_params import SamplingParams
    from rayllm.serve.generation_modes import MAX_SCORING_TOKENS, scoring_fits

    plain = GenerateRequest("r", [[1, 2, 3]], SamplingParams(tenant="t", priority=3), StopOptions())
    assert scoring_fits(plain, ["yes", "no"])
    for change in ({"logit_bias": ((5, 2.0),)}, {"bad_words_token_ids": ((5,),)}, {"allowed_token_ids": (5, 6)},
                   {"presence_penalty": 0.5}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2},
                   {"min_tokens": 2}, {"stop_token_ids": (7,)}, {"return_hidden_states": True}):
        assert not scoring_fits(replace(plain, params=replace(plain.params, **change)), ["yes", "no"]), change
    for stop in (StopOptions(stop=("x",)), StopOptions(stop_regex=("x+",))):
        assert not scoring_fits(replace(plain, stop=stop), ["yes", "no"])
    # Few prompt tokens, long choices: the choices' own tokens are what a scoring prefill costs.
    long = [f"{i:04}" + "x" * 1020 for i in range(64)]  # guided_choice's bound: 1024 characters a choice
    assert 64 * 1 < MAX_SCORING_TOKENS < 64 * 1024 + 64
    assert not scoring_fits(replace(plain, prompts=[[1]]), long)
