"""What the ingress enforces around a request: server limits (bounds, body size), the request timeout,
and the model deployment's failures (full queue, dead replica) as OpenAI errors."""

# No `from __future__ import annotations`, like the ingress: these run inside the Serve replica.

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

from fastapi import Request
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError

from rayllm.protocol import protocol as P
from rayllm.protocol.errors import APIError, not_found, replica_failed
from rayllm.protocol.structured import literal_choices
from rayllm.schema.sampling_params import GuidedSpec
from rayllm.serve.config import ServerConfig
from rayllm.serve.generation_modes import MAX_SCORED_SEQUENCES

# return_hidden_states: each output token's final hidden state goes back (as JSON numbers) and a whole
# response is held by the ingress; at 4,096 tokens of an 8B model's 4,096 values that is ~0.5 GB at most.
MAX_HIDDEN_STATE_TOKENS = 4096


class Overloaded(APIError):
    """The model deployment's queue is full (Serve's BackPressureError): 503 with Retry-After."""

    def __init__(self, status: int, retry_after_s: float) -> None:
        super().__init__(status, "The server is overloaded: too many requests are queued for the model. "
                         "Retry after the time given in the Retry-After header.",
                         type="server_error" if status >= 500 else None, code="server_overloaded")
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))}


def overloaded(exc: BackPressureError, retry_after_s: float) -> Overloaded:
    # Serve's backpressure_config (status, retry_after_s) wins when the deployment sets one.
    return Overloaded(getattr(exc, "_status_code", None) or 503, getattr(exc, "_retry_after_s", None) or retry_after_s)


def request_timeout(timeout_s: float) -> APIError:
    return APIError(504, f"The request did not finish within the server's request timeout ({timeout_s:g} s).",
                    type="server_error", code="request_timeout")


async def next_batch(it: Any, deadline: float | None, timeout_s: float | None, retry_after_s: float) -> Any:
    """The model call's next streamed batch (None at its end), with the request's timeout enforced (the
    monotonic `deadline`), and a full queue or a dead replica as OpenAI errors.

    Back-pressure is caught here rather than by an exception handler: Serve installs its own handler
    for BackPressureError on the ingress app (a plain-text 503), replacing any of ours.
    """
    # Errors are raised after the except blocks, so they carry no __context__: Serve's ASGI wrapper
    # answers any exception whose context is a BackPressureError with its own plain-text 503.
    err: APIError | None = None
    try:
        # asyncio.timeout, not wait_for: no extra task per batch on the hot path.
        async with asyncio.timeout(None if deadline is None else max(deadline - time.monotonic(), 0)):
            return await anext(it)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        err = request_timeout(timeout_s or 0)
    except BackPressureError as exc:
        err = overloaded(exc, retry_after_s)
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        err = replica_failed(type(exc).__name__)
    raise err


def cancel(gen: Any) -> None:
    """Cancel a streaming model call. Serve's cancel() re-raises the error of a call that never started
    (its queue was full): there is nothing to cancel then, and the request's own error stands."""
    try:
        gen.cancel()
    except Exception:  # the call's failure is already the request's answer
        pass


async def call_model(call: Awaitable[Any], retry_after_s: float) -> Any:
    """A unary call to a model deployment, with a full queue or a dead replica as the same OpenAI errors
    as `next_batch`; raised outside the except block, as there."""
    err: APIError | None = None
    try:
        return await call
    except BackPressureError as exc:
        err = overloaded(exc, retry_after_s)
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        err = replica_failed(type(exc).__name__)
    raise err


def check_n(config: ServerConfig, n: int | None, best_of: int | None = None) -> None:
    if config.max_n and (n or 1) > config.max_n:
        raise APIError(400, f"n ({n}) exceeds this server's limit of {config.max_n} choices (max_n).",
                       param="n", code="n_too_large")
    if config.max_n and best_of is not None and best_of > config.max_n:
        raise APIError(400, f"best_of ({best_of}) exceeds this server's limit of {config.max_n} (max_n).",
                       param="best_of", code="best_of_too_large")


def check_tokens(config: ServerConfig, req: P.SamplingFields, prompt_len: int, param: str,
                 max_model_len: int) -> int:
    """Server-side token bounds for one prompt; returns the context the request is then validated against
    (max_total_tokens also caps the default max_tokens)."""
    if config.max_prompt_tokens and prompt_len > config.max_prompt_tokens:
        raise APIError(400, f"The prompt has {prompt_len} tokens; this server accepts at most "
                       f"{config.max_prompt_tokens} prompt tokens (max_prompt_tokens).", param=param,
                       code="prompt_too_long")
    if config.max_total_tokens:
        name, max_tokens = P._requested_max_tokens(req)
        if prompt_len >= config.max_total_tokens:
            raise APIError(400, f"The prompt has {prompt_len} tokens; this server's limit is "
                           f"{config.max_total_tokens} tokens per request, prompt and output together "
                           "(max_total_tokens).", param=param, code="max_total_tokens_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > config.max_total_tokens:
            raise APIError(400, f"The prompt ({prompt_len} tokens) plus {name} ({max_tokens}) exceeds this "
                           f"server's limit of {config.max_total_tokens} tokens per request (max_total_tokens).",
                           param=name, code="max_total_tokens_exceeded")
    return min(max_model_len, config.max_total_tokens or max_model_len)


def check_request(config: ServerConfig, req: P.SamplingFields, num_prompts: int,
                  guided: GuidedSpec | None = None) -> int:
    """The server's per-request bounds that need no tokenizing; returns the engine sequences that generate
    (prompts x max(n, best_of)). `guided`: the request's constraint, whose literal choices may be scored."""
    best_of = getattr(req, "best_of", None)
    check_n(config, req.n, best_of)
    check_chat_template(config, getattr(req, "chat_template", None))
    seqs = check_fanout(config, num_prompts, req.n, best_of)
    check_scored_choices(config, num_prompts, guided)
    return seqs


def check_sampling(config: ServerConfig, req: P.SamplingFields, seqs: int, max_tokens: int, vocab: int,
                   prompts: list[list[int]] = ()) -> None:
    """The bounds that need the vocabulary and the final max_tokens."""
    check_vocab(req, vocab, prompts)
    check_requested_tokens(config, req, seqs, max_tokens)
    if req.return_hidden_states and seqs * max_tokens > MAX_HIDDEN_STATE_TOKENS:
        name, _ = P._requested_max_tokens(req)
        raise APIError(400, f"return_hidden_states keeps a vector per output token: at most {MAX_HIDDEN_STATE_TOKENS} "
                       f"tokens per request with it ({seqs} sequences x {name} {max_tokens}; set {name} lower)",
                       param="return_hidden_states", code="too_many_requested_tokens")


def check_fanout(config: ServerConfig, num_prompts: int, n: int | None, best_of: int | None = None) -> int:
    """Engine sequences the request starts (prompts x max(n, best_of)); a 400 beyond the server's cap."""
    per_prompt = max(n or 1, best_of or 1)
    seqs = num_prompts * per_prompt
    if config.max_sequences_per_request and seqs > config.max_sequences_per_request:
        param = "prompt" if num_prompts > 1 else ("best_of" if (best_of or 0) > (n or 1) else "n")
        raise APIError(400, f"This request asks for {seqs} sequences ({num_prompts} prompt(s) x {per_prompt} "
                       f"choices); this server allows at most {config.max_sequences_per_request} per request "
                       "(max_sequences_per_request).", param=param, code="too_many_sequences")
    return seqs


def check_scored_choices(config: ServerConfig, num_prompts: int, guided: GuidedSpec | None) -> None:
    """Literal choices are scored one engine sequence a prompt and choice (rayllm.serve.generation_modes), up
    to MAX_SCORED_SEQUENCES of them; past that they are sampled under their grammar (prompts x n, counted
    already). Scored sequences count against max_sequences_per_request: a 400 naming the constraint beyond."""
    choices = literal_choices(guided)
    if choices is None or guided is None or num_prompts * len(choices) > MAX_SCORED_SEQUENCES:
        return
    seqs, cap = num_prompts * len(choices), config.max_sequences_per_request
    if cap and seqs > cap:
        raise APIError(400, f"This request scores {seqs} sequences ({num_prompts} prompt(s) x {len(choices)} "
                       f"choices of {guided.param}); this server allows at most {cap} per request "
                       "(max_sequences_per_request).", param=guided.param, code="too_many_sequences")


def check_requested_tokens(config: ServerConfig, req: P.SamplingFields, seqs: int, max_tokens: int) -> None:
    """Output tokens the request may generate in all (sequences x max_tokens); a 400 beyond the cap."""
    total = seqs * max_tokens
    if config.max_requested_tokens and total > config.max_requested_tokens:
        name, given = P._requested_max_tokens(req)
        how = "" if given is not None else " (the default: what the context leaves; set it lower)"
        raise APIError(400, f"This request may generate {total} tokens ({seqs} sequences x {name} "
                       f"{max_tokens}{how}); this server allows at most {config.max_requested_tokens} per "
                       "request (max_requested_tokens).", param=name, code="too_many_requested_tokens")


def check_chat_template(config: ServerConfig, chat_template: str | None) -> None:
    if chat_template is not None and not config.allow_request_chat_template:
        raise APIError(400, "Request-level chat templates are disabled on this server "
                       "(allow_request_chat_template); the model's own template is used without it.",
                       param="chat_template", code="chat_template_not_allowed")


def check_vocab(req: P.SamplingFields, vocab: int, prompts: list[list[int]] = ()) -> None:
    """Token ids a request names must exist (the engine would ignore the rest; say so instead)."""
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    bad = [k for k in req.logit_bias or {} if int(k) >= vocab]
    if bad:
        raise APIError(400, f"logit_bias token {bad[0]} is not in the vocabulary [0, {vocab})", param="logit_bias")
    for name in ("stop_token_ids", "allowed_token_ids"):
        bad_ids = [t for t in getattr(req, name) or () if t >= vocab]
        if bad_ids:
            raise APIError(400, f"{name}: {bad_ids[0]} is not in the vocabulary [0, {vocab})", param=name)


def check_token_list(tokens: list[int], vocab: int, param: str = "tokens") -> None:
    """/detokenize's ids: each must exist (the tokenizer would drop an unknown one silently)."""
    if bad := [i for i, t in enumerate(tokens) if t >= vocab]:
        raise APIError(400, f"{param}.{bad[0]}: token id {tokens[bad[0]]} is not in the vocabulary [0, {vocab})",
                       param=f"{param}.{bad[0]}", code="invalid_value")


def body_limit(request: Request) -> int:
    return getattr(request.app.state, "max_request_bytes", 0)


def too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"The request body ({size} bytes) exceeds this server's limit of {limit} bytes "
                    "(max_request_bytes).", code="request_too_large")


def conversation_not_found(cid: str) -> APIError:
    return not_found(f"Conversation with id '{cid}' not found.", param="conversation", code="conversation_not_found")
