"""OpenAI's Responses API, output side: engine deltas -> Response output items, and the semantic stream
events that build them (each with its sequence_number), as the SDK's `responses.stream` helper reads them.

One ResponseAssembler serves both a stream and a whole response, so the two never disagree: it is fed the
pieces the chat path's output parser (reasoning, tool calls) made of each delta (rayllm.protocol.choice_state).
"""

from __future__ import annotations

import json
import time
from typing import Any

from rayllm.protocol.choice_state import ParsedPieces
from rayllm.protocol.errors import APIError, server_error
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses_api import ResponseCreate, new_item_id

# The error of a response whose generation was aborted (one of OpenAI's ResponseError codes).
ABORTED = {"code": "server_error", "message": "The generation was aborted before it finished (e.g. its LoRA "
                                              "adapter was unloaded); retry the request."}

def skeleton(req: ResponseCreate, response_id: str, model: str, conversation_id: str | None) -> dict[str, Any]:
    """The Response object before any output: what response.created carries, and the final body's frame."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    tools = [dict(t) | {"strict": t.get("strict", True)} for t in req.tools or []]
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "background": False, "completed_at": None, "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "store": req.store is not False, "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt or {"type": "text"}}, "tool_choice": req.tool_choice or "auto", "tools": tools,
        "top_logprobs": req.top_logprobs, "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
    }


def sse(event: dict[str, Any]) -> str:
    """OpenAI's framing for Responses streams: a named event, then its JSON (no [DONE] at the end)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'), ensure_ascii=False)}\n\n"


class ResponseAssembler:
    """Deltas of one generation in, semantic events out; `final()` is the whole Response."""

    def __init__(self, frame: dict[str, Any]) -> None:
        self.frame = frame
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written (the last of self.output)
        self.pending_logprobs: list[dict] = []  # logprobs of text the parser still holds back
        self.prompt_tokens = self.cached_tokens = self.output_tokens = self.reasoning_tokens = 0
        self.finish_reason: str | None = None

    # ---- events ------------------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def feed(self, d: GenerationDelta, pieces: ParsedPieces | None) -> list[dict[str, Any]]:
        """A delta and its parsed pieces (None: the choice is not parsed, its text is the answer)."""
        self.prompt_tokens, self.cached_tokens = d.prompt_tokens, d.cached_tokens
        new_tokens = d.completion_tokens - self.output_tokens
        self.output_tokens = d.completion_tokens
        parts: list[dict[str, Any]]
        if pieces is None:
            self.pending_logprobs.extend(d.logprobs or [])
            parts = [{"content": d.text}] if d.text else []
        else:  # only the tokens of the answer's text: not reasoning, think tags or tool calls
            self.pending_logprobs.extend(pieces.text_logprobs)
            parts = pieces
        if parts and all("reasoning_content" in p for p in parts):
            self.reasoning_tokens += new_tokens  # a delta spanning both is counted as answer
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
        events: list[dict[str, Any]] = []
        for piece in parts:
            events += self._piece(piece)
        return events

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.get("reasoning_content"):
            events += self._ensure("reasoning")
            self.open["content"][0]["text"] += piece["reasoning_content"]  # type: ignore[index]
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                     output_index=len(self.output) - 1, content_index=0,
                                     delta=piece["reasoning_content"]))
        if piece.get("content"):
            events += self._ensure("message")
            part = self.open["content"][0]  # type: ignore[index]
            part["text"] += piece["content"]
            lps, self.pending_logprobs = self.pending_logprobs, []
            part["logprobs"].extend(lps)
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                     output_index=len(self.output) - 1, content_index=0, delta=piece["content"],
                                     logprobs=lps))
        for call in piece.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):  # a new call opens
                events += self._close()
                events += self._add({"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                                     "call_id": call["id"], "name": fn.get("name") or "", "arguments": ""})
            if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.output) - 1, delta=fn["arguments"]))
        return events

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        """Opens an item of `kind` (closing the one before) unless one is being written."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self._close()
        if kind == "message":
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": new_item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": []}
        events += self._add(item)
        item["content"].append(part)
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                                 content_index=0, part={k: (list(v) if isinstance(v, list) else v)
                                                         for k, v in part.items()}))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item={k: (list(v) if isinstance(v, list) else v) for k, v in item.items()})]

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        item["status"] = "incomplete" if self.finish_reason in ("length", "abort") else "completed"
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"].extend(self.pending_logprobs)
            self.pending_logprobs = []
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=part["logprobs"]))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"]))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        if item["type"] != "function_call":
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=dict(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Closes the last item (an empty answer is still one message): the events before the final one."""
        events = self._close()
        if not self.output:
            events += self._ensure("message") + self._close()
        return events

    def done_event(self) -> dict[str, Any]:
        body = self.final()
        return self.event(f"response.{body['status']}", response=body)  # completed, incomplete or failed

    def error_events(self, exc: BaseException) -> list[dict[str, Any]]:
        """A failure after the stream began: an `error` event, then response.failed carrying what was generated
        (its output, as the events before built it, and its usage: a response that was made but could not be
        stored is all there)."""
        err = exc if isinstance(exc, APIError) else server_error(f"internal error: {type(exc).__name__}")
        code = str(err.code or err.type)
        # A Response's error.code is one of OpenAI's ResponseError codes; the `error` event keeps ours.
        kind = {429: "rate_limit_exceeded"}.get(err.status_code, "server_error" if err.status_code >= 500
                                                else "invalid_prompt")
        snap = dict(self.frame, status="failed", output=self.output, usage=self.usage(),
                    error={"code": kind, "message": err.message})
        return [self.event("error", code=code, message=err.message, param=err.param),
                self.event("response.failed", response=snap)]

    # ---- bodies ------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return dict(self.frame, output=[])

    def usage(self) -> dict[str, Any]:
        # cache_write_tokens: OpenAI's billed explicit cache writes; the prefix cache here has none.
        details = {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0}
        return {"input_tokens": self.prompt_tokens, "input_tokens_details": details,
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.prompt_tokens + self.output_tokens}

    def final(self) -> dict[str, Any]:
        # An abort (its LoRA adapter unloaded, the engine gave up on it) is a failure in OpenAI's terms: a
        # `failed` response with its error, which the SDK's stream helper reports (no response.completed).
        status = {"length": "incomplete", "abort": "failed"}.get(self.finish_reason or "", "completed")
        return dict(self.frame, status=status, output=self.output, usage=self.usage(),
                    completed_at=int(time.time()) if status == "completed" else None,
                    error=dict(ABORTED) if status == "failed" else None,
                    incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None)
