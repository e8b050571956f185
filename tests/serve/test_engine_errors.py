"""The model deployment's mapping of engine exceptions to OpenAI errors (rayllm.serve.engine_errors)."""

from __future__ import annotations

import pickle

from rayllm.schema.outputs import NO_TOKEN_LEFT, EngineDeadError, RequestRefused, SequenceError
from rayllm.serve.engine_errors import engine_failure, refusal, step_failure


def test_a_refusal_names_the_field_the_engine_named_else_the_callers():
    crossed = pickle.loads(pickle.dumps(RequestRefused("prompt (9) + max_tokens (9) exceeds", param="max_tokens")))
    err = refusal(crossed, "response_format")
    assert (err.status_code, err.param, err.message) == (400, "max_tokens", "prompt (9) + max_tokens (9) exceeds")
    assert refusal(RequestRefused("grammar too large"), "response_format").param == "response_format"
    assert refusal(ValueError("other"), None).param is None  # no guess: the old "max_tokens" was wrong as often


def test_step_and_engine_failures():
    assert step_failure(SequenceError("r", "OutOfMemoryError: x")).status_code == 503
    assert step_failure(SequenceError("r", "IndexError: y")).code == "sequence_failed"
    own = step_failure(SequenceError("r", f"ValueError: {NO_TOKEN_LEFT}"))  # the request's own parameters
    assert (own.status_code, own.code) == (400, "no_token_to_sample")
    assert engine_failure(EngineDeadError("dead\nmore")).status_code == 503
    other = RuntimeError("x")
    assert engine_failure(other) is other
