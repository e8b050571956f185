"""Engine text deltas -> OpenAI responses: SSE chunks for streams, one assembled body otherwise.

Chunks are built as plain dicts and serialised once: this runs for every streamed delta.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.errors import APIError

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class GenerationDelta:
    """What the model deployment yields per choice per step."""

    index: int  # choice index (several prompts: prompt_i * n + j)
    text: str  # new text since the previous delta (stop strings already handled)
    token_ids: list[int]
    logprobs: list[dict] | None  # per new token: {"token", "logprob", "bytes", "top_logprobs": [...]}
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    matched_stop: str | int | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # cumulative for this choice
    prompt_logprobs: list[dict | None] | None = None  # first delta only, echo + logprobs
    prompt_text: str | None = None  # first delta only, completions echo


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def sse_error(err: APIError) -> str:
    return sse_event(err.to_dict())


class Usage:
    """Token counts over every choice; a prompt is counted once however many choices it has."""

    def __init__(self, n: int):
        self.n = n
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


def legacy_logprobs(entries: list[dict | None], text_start: int) -> dict[str, Any]:
    """Completions' legacy shape: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = text_start
    for e in entries:
        if e is None:
            continue
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]} or None)
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def _prompt_entries(d: GenerationDelta) -> list[dict | None]:
    # The first prompt token comes with a null logprob, as OpenAI's echo reports it.
    return list(d.prompt_logprobs or [])


def _stream_end(base: dict[str, Any], usage: Usage, include_usage: bool) -> list[str]:
    """The usage chunk (empty choices) when asked for, then [DONE]."""
    events = [sse_event(base | {"choices": [], "usage": usage.to_dict()})] if include_usage else []
    return events + [SSE_DONE]


async def stream_chat(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str, created: int,
                      n: int, include_usage: bool = False, continuous_usage_stats: bool = False
                      ) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    usage = Usage(n)
    started: set[int] = set()
    try:
        async for d in deltas:
            usage.add(d)
            extra = {"usage": usage.to_dict()} if continuous_usage_stats else {}
            if d.index not in started:
                started.add(d.index)
                yield sse_event(base | {"choices": [{"index": d.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]} | extra)
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue
            choice: dict[str, Any] = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                                      "logprobs": {"content": d.logprobs} if d.logprobs else None,
                                      "finish_reason": d.finish_reason}
            if d.finish_reason is not None:
                choice["matched_stop"] = d.matched_stop
            yield sse_event(base | {"choices": [choice]} | extra)
    except APIError as err:
        yield sse_error(err)
        yield SSE_DONE
        return
    for event in _stream_end(base, usage, include_usage):
        yield event


async def stream_completion(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str, created: int,
                            n: int, include_usage: bool = False, continuous_usage_stats: bool = False
                            ) -> AsyncIterator[str]:
    base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    usage = Usage(n)
    offsets: dict[int, int] = {}
    try:
        async for d in deltas:
            usage.add(d)
            text = d.text
            entries: list[dict | None] = []
            if d.index not in offsets:
                offsets[d.index] = 0
                if d.prompt_text is not None:
                    text = d.prompt_text + text
                    entries = _prompt_entries(d)
            entries += d.logprobs or []
            if not text and d.finish_reason is None and not entries:
                continue
            choice: dict[str, Any] = {"index": d.index, "text": text, "finish_reason": d.finish_reason,
                                      "logprobs": legacy_logprobs(entries, offsets[d.index]) if entries else None}
            if d.finish_reason is not None:
                choice["matched_stop"] = d.matched_stop
            offsets[d.index] += len(text)
            extra = {"usage": usage.to_dict()} if continuous_usage_stats else {}
            yield sse_event(base | {"choices": [choice]} | extra)
    except APIError as err:
        yield sse_error(err)
        yield SSE_DONE
        return
    for event in _stream_end(base, usage, include_usage):
        yield event


async def collect_chat(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str, created: int,
                       n: int) -> dict[str, Any]:
    usage = Usage(n)
    choices: dict[int, dict[str, Any]] = {}
    async for d in deltas:
        usage.add(d)
        c = choices.setdefault(d.index, {"index": d.index, "message": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None})
        c["message"]["content"] += d.text
        if d.logprobs:
            c["logprobs"] = c["logprobs"] or {"content": []}
            c["logprobs"]["content"] += d.logprobs
        if d.finish_reason is not None:
            c["finish_reason"] = d.finish_reason
            c["matched_stop"] = d.matched_stop
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choices[i] for i in sorted(choices)], "usage": usage.to_dict(),
            "system_fingerprint": None}


async def collect_completion(deltas: AsyncIterator[GenerationDelta], *, request_id: str, model: str,
                             created: int, n: int) -> dict[str, Any]:
    usage = Usage(n)
    choices: dict[int, dict[str, Any]] = {}
    entries: dict[int, list[dict | None]] = {}
    async for d in deltas:
        usage.add(d)
        c = choices.get(d.index)
        if c is None:
            c = choices[d.index] = {"index": d.index, "text": d.prompt_text or "", "logprobs": None,
                                    "finish_reason": None}
            entries[d.index] = _prompt_entries(d) if d.prompt_text is not None else []
        c["text"] += d.text
        entries[d.index] += d.logprobs or []
        if d.finish_reason is not None:
            c["finish_reason"] = d.finish_reason
            c["matched_stop"] = d.matched_stop
    for i, c in choices.items():
        if entries[i]:
            c["logprobs"] = legacy_logprobs(entries[i], 0)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choices[i] for i in sorted(choices)], "usage": usage.to_dict()}
