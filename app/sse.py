"""Engine text deltas -> OpenAI responses: SSE chunks for streams, one assembled body otherwise.

Pure formatting, no network code. Stream chunks are built as plain dicts and serialised once (this
runs for every streamed delta; their shape is checked against app.responses' chunk models in the
tests); whole responses are the pydantic models of app.responses.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from app.chat_output import ChatOutputParser, merge_deltas
from app.errors import APIError, server_error
from app.responses import (
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
ParserFactory = Callable[[], ChatOutputParser]


@dataclass
class GenerationDelta:
    """What the model deployment yields per choice per step."""

    index: int  # choice index (completions with several prompts: prompt_i * n + j)
    text: str  # new text since the previous delta (stop strings already handled)
    token_ids: list[int]  # new token ids
    logprobs: list[dict] | None  # per new token: {"token", "logprob", "bytes", "top_logprobs": [...]}
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    matched_stop: str | int | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # cumulative for this choice
    prompt_logprobs: list[dict | None] | None = None  # first delta only, echo + logprobs; first entry None
    prompt_text: str | None = None  # first delta only, completions echo
    hidden_states: list[list[float]] | None = None  # return_hidden_states: one vector per new token


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """One server-sent event: compact JSON; a model drops its None fields, a dict is sent as built."""
    if isinstance(payload, BaseModel):
        body = payload.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"data: {body}\n\n"


def sse_error(err: APIError) -> str:
    return sse_event(err.to_dict())


class UsageCounter:
    """Token counts over every choice; a prompt (and its cache hits) counts once however many choices."""

    def __init__(self, n: int) -> None:
        self.n = max(1, n)
        self.prompt: dict[int, tuple[int, int]] = {}
        self.completion: dict[int, int] = {}

    def add(self, d: GenerationDelta) -> None:
        self.prompt[d.index // self.n] = (d.prompt_tokens, d.cached_tokens)
        self.completion[d.index] = d.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        prompt = sum(p for p, _ in self.prompt.values())
        cached = sum(c for _, c in self.prompt.values())
        completion = sum(self.completion.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def to_model(self) -> Usage:
        return Usage.model_validate(self.to_dict())


class LegacyLogprobs:
    """Completions' legacy logprobs (parallel lists) with text_offset, built across deltas."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[dict | None], offset: int) -> None:
        """Tokens whose text starts at `offset` in the choice's text, one after another."""
        for e in entries:
            if e is None:  # a first prompt token reported without its text: null logprob, empty token
                e = {"token": "", "logprob": None, "top_logprobs": []}
            self.tokens.append(e["token"])
            self.token_logprobs.append(e["logprob"])
            top = {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}
            self.top_logprobs.append(top or None)
            self.text_offset.append(offset)
            offset += len(e["token"])

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def legacy_logprobs(entries: list[dict | None], text_start: int = 0) -> dict[str, Any]:
    """Chat-shaped logprob entries as completions' legacy shape, the first token at `text_start`."""
    out = LegacyLogprobs()
    out.add(entries, text_start)
    return out.to_dict()


def _error_events(exc: Exception, trace_id: str | None = None) -> list[str]:
    """A failure mid-stream becomes an error event, then [DONE]: the 200 and its headers are already sent.

    trace_id: the HTTP request's X-Request-Id, put beside `error` as in the ingress's error bodies.
    """
    if not isinstance(exc, APIError):  # anything else is ours: log it, keep the stream well-formed
        log.error("stream failed (request %s)", trace_id, exc_info=exc)
        exc = server_error(f"internal error: {type(exc).__name__}")
    body = exc.to_dict() | ({"request_id": trace_id} if trace_id else {})
    return [sse_event(body), SSE_DONE]


async def stream_chat(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str, created: int,
                      n: int = 1, include_usage: bool = False, continuous_usage_stats: bool = False,
                      parser_factory: ParserFactory | None = None, trace_id: str | None = None) -> AsyncIterator[str]:
    """SSE events of /v1/chat/completions: role, content deltas, finish, [usage chunk], [DONE].

    parser_factory: one ChatOutputParser per choice, when reasoning or tool calls are parsed out of the text.
    """
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    usage = UsageCounter(n)
    started: set[int] = set()
    parsers: dict[int, ChatOutputParser] = {}
    try:
        async for d in deltas:
            usage.add(d)
            extra = {"usage": usage.to_dict()} if continuous_usage_stats else {}
            if d.index not in started:  # each choice opens with the role
                started.add(d.index)
                yield sse_event(base | {"choices": [{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]} | extra)
            if parser_factory is not None:
                parser = parsers.get(d.index) or parsers.setdefault(d.index, parser_factory())
                for choice in _parsed_choices(parser, d):
                    yield sse_event(base | {"choices": [choice]} | extra)
                continue
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue  # nothing to say yet (e.g. a stop string may be forming)
            choice: dict[str, Any] = {"index": d.index,
                                      "delta": {"content": d.text} if d.text or d.logprobs else {},
                                      "logprobs": {"content": d.logprobs} if d.logprobs else None,
                                      "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["matched_stop"] = d.matched_stop
            if d.hidden_states:
                choice["hidden_states"] = d.hidden_states
            yield sse_event(base | {"choices": [choice]} | extra)
    except Exception as exc:
        for event in _error_events(exc, trace_id):
            yield event
        return
    if include_usage:
        yield sse_event(base | {"choices": [], "usage": usage.to_dict()})
    yield SSE_DONE


def _parsed_choices(parser: ChatOutputParser, d: GenerationDelta) -> list[dict[str, Any]]:
    """A delta's text through the choice's parser: zero or more content / reasoning / tool-call chunks."""
    pieces = parser.feed(d.text) if d.text else []
    if d.finish_reason is not None:
        pieces += parser.finish()
    lp = {"content": d.logprobs} if d.logprobs else None
    out = [{"index": d.index, "delta": piece, "logprobs": lp if k == 0 else None, "finish_reason": None}
           for k, piece in enumerate(pieces)]
    if (lp is not None or d.hidden_states) and not out:
        out.append({"index": d.index, "delta": {}, "logprobs": lp, "finish_reason": None})
    if d.hidden_states:
        out[0]["hidden_states"] = d.hidden_states
    if d.finish_reason is not None:
        out.append({"index": d.index, "delta": {}, "logprobs": None,
                    "finish_reason": parser.finish_reason(d.finish_reason), "matched_stop": d.matched_stop})
    return out


async def stream_completion(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str,
                            created: int, n: int = 1, include_usage: bool = False,
                            continuous_usage_stats: bool = False, trace_id: str | None = None) -> AsyncIterator[str]:
    """SSE events of /v1/completions: text deltas (echo: the prompt first), finish, [usage chunk], [DONE]."""
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    usage = UsageCounter(n)
    emitted: dict[int, int] = {}  # characters of text sent so far per choice: the next text_offset
    try:
        async for d in deltas:
            usage.add(d)
            text, lp = d.text, LegacyLogprobs()
            if d.index not in emitted:
                emitted[d.index] = 0
                if d.prompt_text is not None:
                    text = d.prompt_text + text
                    lp.add(d.prompt_logprobs or [], 0)
                    emitted[d.index] = len(d.prompt_text)
            lp.add(d.logprobs or [], emitted[d.index])
            emitted[d.index] += len(d.text)
            if not text and d.finish_reason is None and not lp:
                continue
            choice: dict[str, Any] = {"index": d.index, "text": text,
                                      "logprobs": lp.to_dict() if lp else None, "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["matched_stop"] = d.matched_stop
            if d.hidden_states:
                choice["hidden_states"] = d.hidden_states
            extra = {"usage": usage.to_dict()} if continuous_usage_stats else {}
            yield sse_event(base | {"choices": [choice]} | extra)
    except Exception as exc:
        for event in _error_events(exc, trace_id):
            yield event
        return
    if include_usage:
        yield sse_event(base | {"choices": [], "usage": usage.to_dict()})
    yield SSE_DONE


async def collect_chat(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str, created: int,
                       n: int = 1, parser_factory: ParserFactory | None = None) -> ChatCompletionResponse:
    """The whole /v1/chat/completions body: text concatenated per choice, usage summed over choices."""
    usage = UsageCounter(n)
    texts: dict[int, list[str]] = {}
    logprobs: dict[int, list[dict]] = {}
    finish: dict[int, tuple[str | None, str | int | None]] = {}
    hidden: dict[int, list[list[float]]] = {}
    async for d in deltas:
        usage.add(d)
        if d.hidden_states:
            hidden.setdefault(d.index, []).extend(d.hidden_states)
        texts.setdefault(d.index, []).append(d.text)
        if d.logprobs:
            logprobs.setdefault(d.index, []).extend(d.logprobs)
        if d.finish_reason is not None:
            finish[d.index] = (d.finish_reason, d.matched_stop)
    choices = []
    for i in sorted(texts):
        reason, matched = finish.get(i, (None, None))
        lp = ChatLogprobs.model_validate({"content": logprobs[i]}) if i in logprobs else None
        if parser_factory is not None:  # the same parser as streaming, fed the whole text
            parser = parser_factory()
            fields = merge_deltas(parser.feed("".join(texts[i]), final=True))
            message = ChatResponseMessage.model_validate(fields)
            reason = parser.finish_reason(reason)
        else:
            message = ChatResponseMessage(content="".join(texts[i]))
        choices.append(ChatChoice(index=i, message=message, logprobs=lp, finish_reason=reason,  # type: ignore[arg-type]
                                  matched_stop=matched, hidden_states=hidden.get(i)))
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage.to_model())


async def collect_completion(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str,
                             created: int, n: int = 1) -> CompletionResponse:
    """The whole /v1/completions body: echo prepends the prompt (and its logprobs, the first null)."""
    usage = UsageCounter(n)
    texts: dict[int, list[str]] = {}
    lps: dict[int, LegacyLogprobs] = {}
    lengths: dict[int, int] = {}
    finish: dict[int, tuple[str | None, str | int | None]] = {}
    hidden: dict[int, list[list[float]]] = {}
    async for d in deltas:
        usage.add(d)
        if d.hidden_states:
            hidden.setdefault(d.index, []).extend(d.hidden_states)
        if d.index not in texts:
            texts[d.index], lps[d.index], lengths[d.index] = [], LegacyLogprobs(), 0
            if d.prompt_text is not None:
                texts[d.index].append(d.prompt_text)
                lps[d.index].add(d.prompt_logprobs or [], 0)
                lengths[d.index] = len(d.prompt_text)
        # Each delta's tokens are placed where its text starts, so offsets never drift from the text.
        lps[d.index].add(d.logprobs or [], lengths[d.index])
        texts[d.index].append(d.text)
        lengths[d.index] += len(d.text)
        if d.finish_reason is not None:
            finish[d.index] = (d.finish_reason, d.matched_stop)
    choices = []
    for i in sorted(texts):
        reason, matched = finish.get(i, (None, None))
        lp = CompletionLogprobs.model_validate(lps[i].to_dict()) if lps[i] else None
        choices.append(CompletionChoice(index=i, text="".join(texts[i]), logprobs=lp, finish_reason=reason,
                                        matched_stop=matched, hidden_states=hidden.get(i)))  # type: ignore[arg-type]
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage.to_model())
