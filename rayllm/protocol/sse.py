"""Engine text deltas -> OpenAI responses: SSE chunks for streams, one assembled body otherwise.

Pure formatting, no network code: a format reads the request's GenerationState (rayllm.protocol.choice_state), which
the ingress's stream loop feeds once per delta. Stream chunks are built as plain dicts and serialised once
(this runs for every streamed delta; their shape is checked against rayllm.protocol.responses' chunk models and the
OpenAI SDK in the tests); whole responses are the pydantic models of rayllm.protocol.responses.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel

from rayllm.protocol.choice_state import ChoiceState, GenerationState, LegacyLogprobs
from rayllm.protocol.errors import APIError, server_error
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
Pieces = list[dict[str, Any]] | None


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: compact JSON; a model drops its None fields, a dict is sent as built."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


def error_events(exc: BaseException, trace_id: str | None = None) -> str:
    """A failure mid-stream becomes an error event, then [DONE]: the 200 and its headers are already sent.

    trace_id: the HTTP request's X-Request-Id, put beside `error` as in the ingress's error bodies.
    """
    if not isinstance(exc, APIError):  # anything else is ours: log it, keep the stream well-formed
        log.error("stream failed (request %s)", trace_id, exc_info=exc)
        exc = server_error(f"internal error: {type(exc).__name__}")
    body = exc.to_dict() | ({"request_id": trace_id} if trace_id else {})
    return sse_event(body) + SSE_DONE


class WireFormat:
    """A response's wire format, written from the request's GenerationState.

    The stream loop calls, in order: head(), delta() per delta (after feeding it to the state), finish(),
    tail(); error() when the stream fails after its 200. A whole response: feed() per delta, finish(), body().
    """

    def __init__(self, state: GenerationState) -> None:
        self.state = state

    def head(self) -> str:
        return ""

    def feed(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> None:
        """A delta of a whole (non-streamed) response; formats that read only the state ignore it."""

    def delta(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> str:
        raise NotImplementedError

    def finish(self) -> str:
        return ""

    def tail(self) -> str:
        raise NotImplementedError

    def error(self, exc: BaseException) -> str:
        raise NotImplementedError

    def body(self) -> Any:
        raise NotImplementedError


class OpenAIFormat(WireFormat):
    """What chat and completions share: the chunk frame, usage chunks, [DONE], error events."""

    object_name = ""

    def __init__(self, state: GenerationState, *, request_id: str, model: str, created: int,
                 include_usage: bool = False, continuous_usage_stats: bool = False,
                 trace_id: str | None = None, prompt_token_ids: list[list[int]] | None = None) -> None:
        super().__init__(state)
        self.request_id, self.model, self.created = request_id, model, created
        self.base = {"id": request_id, "object": self.object_name, "created": created, "model": model}
        self.include_usage = include_usage
        self.continuous_usage_stats = continuous_usage_stats
        self.trace_id = trace_id
        # vLLM's return_token_ids: each prompt's ids (None: not asked for); choices carry their tokens too
        self.prompt_token_ids = prompt_token_ids

    def _prompt_ids(self, index: int) -> list[int]:
        """The prompt of choice `index` (choices i * n .. i * n + n - 1 continue prompt i)."""
        assert self.prompt_token_ids is not None
        return self.prompt_token_ids[index // self.state.n]

    def tail(self) -> str:
        usage = sse_event(self.base | {"choices": [], "usage": self.state.usage()}) if self.include_usage else ""
        return usage + SSE_DONE

    def error(self, exc: BaseException) -> str:
        return error_events(exc, self.trace_id)

    def _chunk(self, choice: dict[str, Any], top: dict[str, Any] | None = None) -> str:
        extra = {"usage": self.state.usage()} if self.continuous_usage_stats else {}
        return sse_event(self.base | (top or {}) | {"choices": [choice]} | extra)


class ChatFormat(OpenAIFormat):
    """/v1/chat/completions: role, content deltas (or the parser's content / reasoning / tool-call pieces),
    finish, [usage chunk], [DONE]; or the whole body."""

    object_name = "chat.completion.chunk"

    def delta(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> str:
        out = ""
        ids = self.prompt_token_ids is not None
        if c.deltas == 1:  # each choice opens with the role (and, asked for, the prompt's token ids)
            out = self._chunk({"index": d.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}, {"prompt_token_ids": self._prompt_ids(d.index)} if ids else {})
        if pieces is not None:
            chunks = _parsed_choices(c, d, pieces, with_ids=ids)
            return out + "".join(self._chunk(choice) for choice in chunks)
        if not d.text and d.finish_reason is None and not d.logprobs and not (ids and d.token_ids):
            return out  # nothing to say yet (e.g. a stop string may be forming)
        choice: dict[str, Any] = {"index": d.index, "delta": {"content": d.text} if d.text or d.logprobs else {},
                                  "logprobs": {"content": d.logprobs} if d.logprobs else None,
                                  "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["matched_stop"] = d.matched_stop
        if d.hidden_states:
            choice["hidden_states"] = d.hidden_states
        if ids:
            choice["token_ids"] = d.token_ids
        return out + self._chunk(choice)

    def body(self) -> ChatCompletionResponse:
        """Text concatenated per choice (through its parser when there is one), usage summed over choices."""
        ids = self.prompt_token_ids is not None
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage.model_validate(c.message()),
                              logprobs=ChatLogprobs.model_validate({"content": c.logprobs}) if c.logprobs else None,
                              finish_reason=c.reason(), matched_stop=c.matched_stop,  # type: ignore[arg-type]
                              hidden_states=c.hidden_states or None, token_ids=c.token_ids if ids else None)
                   for c in self.state.sorted_choices()]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=Usage.model_validate(self.state.usage()),
                                      prompt_token_ids=self._prompt_ids(0) if ids else None)


def _parsed_choices(c: ChoiceState, d: GenerationDelta, pieces: list[dict[str, Any]],
                    with_ids: bool = False) -> list[dict[str, Any]]:
    """A delta's parsed pieces as chunk choices: zero or more content / reasoning / tool-call chunks (the
    delta's logprobs, hidden states and token ids on the first)."""
    lp = {"content": d.logprobs} if d.logprobs else None
    out = [{"index": d.index, "delta": piece, "logprobs": lp if k == 0 else None, "finish_reason": None}
           for k, piece in enumerate(pieces)]
    if (lp is not None or d.hidden_states or (with_ids and d.token_ids)) and not out:
        out.append({"index": d.index, "delta": {}, "logprobs": lp, "finish_reason": None})
    if d.hidden_states:
        out[0]["hidden_states"] = d.hidden_states
    if with_ids and d.token_ids:
        out[0]["token_ids"] = d.token_ids
    if d.finish_reason is not None:
        out.append({"index": d.index, "delta": {}, "logprobs": None, "finish_reason": c.reason(),
                    "matched_stop": d.matched_stop})
    return out


class CompletionFormat(OpenAIFormat):
    """/v1/completions: text deltas (echo: the prompt first), finish, [usage chunk], [DONE]; or the whole
    body, whose echo prepends the prompt (and its logprobs, the first null)."""

    object_name = "text_completion"

    def delta(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> str:
        text, lp = d.text, LegacyLogprobs()
        if d.prompt_text is not None:
            text = d.prompt_text + text
            lp.add(d.prompt_logprobs or [], 0)
        lp.add(d.logprobs or [], c.offset)  # each delta's tokens start where its text does
        ids = self.prompt_token_ids is not None
        if not text and d.finish_reason is None and not lp and not (ids and (d.token_ids or c.deltas == 1)):
            return ""
        choice: dict[str, Any] = {"index": d.index, "text": text, "logprobs": lp.to_dict() if lp else None,
                                  "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["matched_stop"] = d.matched_stop
        if d.hidden_states:
            choice["hidden_states"] = d.hidden_states
        if ids:
            if c.deltas == 1:  # the choice's first chunk names its prompt
                choice["prompt_token_ids"] = self._prompt_ids(d.index)
            choice["token_ids"] = d.token_ids
        return self._chunk(choice)

    def body(self) -> CompletionResponse:
        ids = self.prompt_token_ids is not None
        choices = [CompletionChoice(index=c.index, text=c.text, matched_stop=c.matched_stop,
                                    logprobs=CompletionLogprobs.model_validate(c.legacy.to_dict()) if c.legacy else None,
                                    finish_reason=c.finish_reason,  # type: ignore[arg-type]
                                    hidden_states=c.hidden_states or None,
                                    prompt_token_ids=self._prompt_ids(c.index) if ids else None,
                                    token_ids=c.token_ids if ids else None)
                   for c in self.state.sorted_choices()]
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=Usage.model_validate(self.state.usage()))
