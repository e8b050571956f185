"""A chat choice's generated text -> OpenAI message parts: content, reasoning (by both its names) and tool calls.

One streaming parser per choice serves both the SSE stream (each `feed` returns delta dicts) and the
whole response (the same deltas merged), so the two can never disagree. Text that may be the start of
a tag (`<think>`, `</think>`, `<tool_call>`) is held back until it is decided.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any

from rayllm.protocol.holdback import HeldSuffix
from rayllm.protocol.limits import loads_bounded
from rayllm.protocol.tool_formats import LlamaJsonFormat
from rayllm.protocol.tools import ParsedCall, ToolPlan, new_call_id

log = logging.getLogger(__name__)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


_HOLD_THINK_CLOSE = HeldSuffix((THINK_CLOSE,))


class ThinkSplitter:
    """Splits `<think>...</think>` (at the start of the output, or opened by the prompt) from the answer."""

    def __init__(self, starts_inside: bool) -> None:
        self.state = "inside" if starts_inside else "start"
        self.buf = ""
        self.strip_newlines = False  # right after </think>: the answer's leading newlines are layout

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Returns (reasoning, content) decided so far."""
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.state, self.buf = "inside", head[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(head) and not final:
                return "", ""  # could still become <think>
            else:
                self.state = "after"
        if self.state == "inside":
            end = self.buf.find(THINK_CLOSE)
            if end >= 0:
                reasoning, self.buf = self.buf[:end], self.buf[end + len(THINK_CLOSE):]
                self.state, self.strip_newlines = "after", True
            else:
                keep = 0 if final else _HOLD_THINK_CLOSE(self.buf)
                reasoning, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        if self.state == "after":
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                self.strip_newlines = not self.buf
            content, self.buf = self.buf, ""
        return reasoning, content


class ToolExtractor:
    """Turns content text into tool calls as the plan says: (kind, value, start) events, kind "content" (text),
    "call" (ParsedCall), "open" / "args" (a named call's name, then its arguments); `start` is where the event's
    text begins in the content fed so far (what answer text a token wrote: ChatOutputParser.text_spans)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._hold_open = HeldSuffix((plan.format.open,))
        self.buf = ""
        self.consumed = 0  # characters fed before buf
        self.inside = False
        self.started = False
        self.decided = False  # Llama's format: whether the answer is calls is known
        self._scan = 0  # Llama's format: where in buf to look for the next `;` that may end a call
        # A named call in a format that wraps its arguments (Llama's): the text before and after them.
        self._wrap = plan.format.named_wrap(plan.named) if plan.named is not None else ("", "")
        self._named_args = ""  # the arguments passed on so far

    def _take(self, n: int) -> None:
        self.buf, self.consumed = self.buf[n:], self.consumed + n

    def feed(self, text: str, final: bool = False) -> list[tuple[str, Any, int]]:
        mode = self.plan.mode
        if mode == "named":
            return self._named(text, final)
        if isinstance(self.plan.format, LlamaJsonFormat):  # `auto`, and `required` (its grammar writes the same)
            return self._leading(self.plan.format, text, final)
        if mode == "required":
            self.buf += text
            if not final:
                return []
            body, start = self.buf, self.consumed
            self._take(len(body))
            try:
                calls = json.loads(body)
            except (json.JSONDecodeError, RecursionError):  # cut by max_tokens (or absurdly deep): hand back the text
                return [("content", body, start)]
            return [("call", ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)), start)
                    for c in calls]
        return self._tagged(text, final)

    def _named(self, text: str, final: bool) -> list[tuple[str, Any, int]]:
        """The forced call's arguments as they come, less the text its format writes around them."""
        assert self.plan.named is not None
        events: list[tuple[str, Any, int]] = []
        if not self.started:
            self.started = True
            events.append(("open", self.plan.named, 0))
        prefix, suffix = self._wrap
        self.buf += text
        if self.consumed < len(prefix):  # the grammar wrote it: not arguments
            self._take(min(len(prefix) - self.consumed, len(self.buf)))
        keep = min(len(suffix), len(self.buf))
        if final:  # the closing text goes only when the call is whole (not cut by max_tokens)
            whole = keep > 0 and self.buf.endswith(suffix) and _is_json(self._named_args + self.buf[:-keep])
            keep = keep if whole else 0
        args = self.buf[: len(self.buf) - keep]
        if args:
            events.append(("args", args, self.consumed))
            self._named_args += args
            self._take(len(args))
        if final:
            self._take(len(self.buf))
        return events

    def _leading(self, fmt: LlamaJsonFormat, text: str, final: bool) -> list[tuple[str, Any, int]]:
        """A format whose calls are the whole answer (Llama's JSON): its first characters tell calls from text;
        each call goes out once the `;` after it (or the end) shows it whole."""
        self.buf += text
        if not self.decided:
            head = self.buf.lstrip()
            verdict = fmt.starts_call(head) if head else None
            if verdict is None and not final:
                return []
            self.decided, self.inside = True, bool(verdict)
        if not self.inside:
            events = [("content", self.buf, self.consumed)] if self.buf else []
            self._take(len(self.buf))
            return events
        calls, used, scan = fmt.complete_calls(self.buf, self._scan)
        events = [("call", c, self.consumed) for c in calls]
        self._take(used)
        self._scan = scan - used
        if final and self.buf:
            rest = fmt.parse(self.buf) if self.buf.strip() else []
            if rest is None:  # not calls after all (or cut by max_tokens): the text as the model wrote it
                events.append(("content", self.buf, self.consumed))
            else:
                events.extend(("call", c, self.consumed) for c in rest)
            self._take(len(self.buf))
        return events

    def _tagged(self, text: str, final: bool) -> list[tuple[str, Any, int]]:
        """The model's own format: text, then calls between the format's open (and close) tags."""
        fmt = self.plan.format
        self.buf += text
        events: list[tuple[str, Any, int]] = []
        while self.buf:
            if not self.inside:
                start = self.buf.find(fmt.open)
                if start < 0:
                    keep = 0 if final else self._hold_open(self.buf)
                    if len(self.buf) > keep:
                        events.append(("content", self.buf[: len(self.buf) - keep], self.consumed))
                    self._take(len(self.buf) - keep)
                    break
                if start:
                    events.append(("content", self.buf[:start], self.consumed))
                self._take(start + len(fmt.open))
                self.inside = True
            end = self.buf.find(fmt.close) if fmt.close is not None else -1
            if end < 0 and not final:
                break
            body = self.buf if end < 0 else self.buf[:end]
            try:
                calls = fmt.parse(body)
            except RecursionError:  # JSON nested past the parser's depth: no call
                calls = None
            if calls is None:  # not a call after all: keep the text as the model wrote it
                events.append(("content", fmt.open + body + ("" if end < 0 else fmt.close or ""),
                               self.consumed - len(fmt.open)))
            else:
                events.extend(("call", c, self.consumed) for c in calls)
            self._take(len(self.buf) if end < 0 else end + len(fmt.close or ""))
            self.inside = False
        return events


def _is_json(text: str) -> bool:
    try:
        loads_bounded(text)
    except ValueError:
        return False
    return True


def _reasoning(text: str) -> dict[str, str]:
    # vLLM now names the field `reasoning`; SGLang and older clients read `reasoning_content`: both, the same text.
    return {"reasoning": text, "reasoning_content": text}


class ChatOutputParser:
    """Per choice: text deltas in, OpenAI delta dicts out ({content} / {reasoning, reasoning_content} /
    {tool_calls} / {function_call}).

    It also records where in the raw output (the text fed) the answer's content came from, `text_spans`, and up
    to where it has decided what the output is, `decided`: the Responses API gives output_text the logprobs of
    those tokens only (rayllm.protocol.choice_state.TextTokens).
    """

    def __init__(self, *, reasoning: bool = False, starts_in_reasoning: bool = False, stream_reasoning: bool = True,
                 include_reasoning: bool = True, tools: ToolPlan | None = None) -> None:
        self.think = ThinkSplitter(starts_in_reasoning) if reasoning else None
        self.stream_reasoning = stream_reasoning
        self.include_reasoning = include_reasoning
        self.held_reasoning = ""
        self.tools = ToolExtractor(tools) if tools is not None and tools.mode != "none" else None
        self.legacy = bool(tools and tools.legacy)
        # parallel_tool_calls: false (and the legacy functions, which name one call): the first call only.
        self.single = tools is not None and not tools.parallel
        self.named = tools is not None and tools.mode == "named"
        self.num_calls = 0
        self._call_id: str | None = None
        self.fed = 0  # raw output characters fed
        self.content_fed = 0  # of which passed on as the answer (after the reasoning)
        self.text_spans: list[list[int]] = []  # [start, end) in the raw output of the content emitted, merged

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    @property
    def decided(self) -> int:
        """Raw output characters whose part (content, reasoning, tags, calls) is known: all but those held back."""
        return self.fed - len(self.think.buf if self.think else "") - len(self.tools.buf if self.tools else "")

    def _content(self, text: str, raw_start: int) -> dict[str, str]:
        spans = self.text_spans
        if spans and spans[-1][1] == raw_start:
            spans[-1][1] += len(text)
        else:
            spans.append([raw_start, raw_start + len(text)])
        return {"content": text}

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        self.fed += len(text)
        if self.think is not None:
            reasoning, text = self.think.feed(text, final)
            if reasoning and self.include_reasoning:
                if self.stream_reasoning:
                    deltas.append(_reasoning(reasoning))
                else:
                    self.held_reasoning += reasoning
            if self.held_reasoning and (self.think.state == "after" or final):
                deltas.append(_reasoning(self.held_reasoning))
                self.held_reasoning = ""
        self.content_fed += len(text)
        # Where the answer's first character is in the raw output; fixed once the answer began (all after the
        # thought is answer), so it places every content offset the extractor reports.
        shift = self.fed - self.content_fed
        if self.tools is None:
            if text:
                deltas.append(self._content(text, self.fed - len(text)))
            return deltas
        for kind, value, start in self.tools.feed(text, final):
            if kind == "content":
                if value.strip() or not self.called:  # whitespace between calls is not content
                    deltas.append(self._content(value, start + shift))
            elif kind == "open":
                deltas.append(self._open(value))
            elif kind == "args":
                deltas.append(self._args(value))
            elif not (self.single and self.called):
                deltas.append(self._open(value.name))
                deltas.append(self._args(value.arguments))
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        return self.feed("", final=True)

    def _open(self, name: str) -> dict[str, Any]:
        self.num_calls += 1
        if self.legacy:
            return {"function_call": {"name": name, "arguments": ""}}
        self._call_id = new_call_id()
        return {"tool_calls": [{"index": self.num_calls - 1, "id": self._call_id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _args(self, text: str) -> dict[str, Any]:
        if self.legacy:
            return {"function_call": {"arguments": text}}
        return {"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]}

    def finish_reason(self, reason: str | None) -> str | None:
        # A call the model chose to make ends with `tool_calls` (`function_call`); one the request forced by
        # name ends with `stop`, as OpenAI and vLLM answer it.
        if self.called and reason == "stop" and not self.named:
            return "function_call" if self.legacy else "tool_calls"
        return reason


def output_parser_factory(req: Any, plan: ToolPlan | None, prompt_text: str, model_reasons: bool,
                          constrained: bool) -> Callable[[], ChatOutputParser] | None:
    """How each choice's text of a chat request becomes content / reasoning_content / tool_calls: a
    parser per choice, or None when all of it is content. `model_reasons`: the model writes <think>
    (from its chat template, or the server's reasoning_parser setting). `constrained`: a grammar shapes the
    output from its first token (response_format, guided_*, a tool_choice that forces a call)."""
    template_reasons = bool(req.chat_template and "<think>" in req.chat_template)
    reasoning = req.separate_reasoning is True or (
        req.separate_reasoning is None and (model_reasons or template_reasons))
    if not model_reasons and (req.reasoning_effort is not None or req.enable_thinking is not None):
        log.info("reasoning_effort / enable_thinking passed to the chat template; this model does not reason")
    tools_active = plan is not None and plan.mode != "none"
    if not reasoning and not tools_active:
        return None
    return functools.partial(ChatOutputParser, reasoning=reasoning,
                             # A prompt that opens <think> leaves the model inside its thought, but a grammar
                             # applies from the first token: what it shapes is the answer, not a thought.
                             starts_in_reasoning=(reasoning and not constrained
                                                  and prompt_text.rstrip().endswith("<think>")),
                             stream_reasoning=req.stream_reasoning is not False,
                             include_reasoning=getattr(req, "include_reasoning", True) is not False,
                             tools=plan if tools_active else None)


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas of one choice -> the message fields of the whole response."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    function_call: dict[str, Any] | None = None
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        if "reasoning_content" in d:
            reasoning.append(d["reasoning_content"])
        for c in d.get("tool_calls") or []:
            call = calls.setdefault(c["index"], {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            call["id"] = c.get("id") or call["id"]
            fn = c.get("function") or {}
            call["function"]["name"] += fn.get("name") or ""
            call["function"]["arguments"] += fn.get("arguments") or ""
        if "function_call" in d:
            fc = d["function_call"]
            function_call = function_call or {"name": "", "arguments": ""}
            function_call["name"] += fc.get("name") or ""
            function_call["arguments"] += fc.get("arguments") or ""
    text = "".join(content)
    out: dict[str, Any] = {"content": text if text or not (calls or function_call) else None}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    if function_call:
        out["function_call"] = function_call
    return out
