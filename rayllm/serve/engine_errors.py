"""Engine exceptions as the OpenAI errors a client sees (the model deployment's one mapping)."""

from __future__ import annotations

from rayllm.common.errors import first_line
from rayllm.protocol.errors import APIError, replica_failed
from rayllm.schema.outputs import NO_TOKEN_LEFT, EngineDeadError, SequenceError


def step_failure(exc: SequenceError) -> APIError:
    """A request that failed inside a step, the engine serving on: a 503 to retry when the device ran out of
    memory in the step (engine.LLMEngine._fail_step), a 400 when its own parameters left no token to
    sample, else a 500."""
    if NO_TOKEN_LEFT in str(exc):
        return APIError(400, NO_TOKEN_LEFT[0].upper() + NO_TOKEN_LEFT[1:] + ".", code="no_token_to_sample")
    if str(exc).startswith("OutOfMemoryError:"):
        return APIError(503, f"The request failed inside the model step: {exc}", type="server_error",
                        code="out_of_memory")
    return APIError(500, f"The request failed inside the model step: {exc}", type="server_error",
                    code="sequence_failed")


def engine_failure(exc: Exception) -> Exception:
    """A dead engine (a TP actor died, a step raised) is a clear, retryable 503; anything else passes as is."""
    if isinstance(exc, EngineDeadError):
        return replica_failed(first_line(exc))  # Ray's actor errors run to many lines
    return exc


def refusal(exc: ValueError, default_param: str | None) -> APIError:
    """The engine refused the request as sent: a 400 naming the field it named (engine.RequestRefused),
    else the caller's best guess (the constraint's field for a grammar it would not take)."""
    return APIError(400, str(exc), param=getattr(exc, "param", None) or default_param)
