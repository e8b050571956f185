"""How model families write tool calls: recognising a call in the output, and the grammars that keep one valid.

- Hermes (SmolLM2, Qwen2.5, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere.
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end of the output.
- Llama 3.1 / 3.2 / 3.3 (`llama3_json`): the whole answer is `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`, several calls separated by `;` (as vLLM's llama3_json parser reads them; "arguments" is
  accepted for "parameters"). A call is only recognised where the answer begins, as vLLM's streaming parser
  does: JSON further into a text answer stays text.

A call counts only when its arguments are a JSON object (or a string holding one): anything else stays text,
so what reaches the client always parses as OpenAI's SDK expects (json.loads of `arguments` to a dict).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rayllm.protocol.limits import MAX_JSON_DEPTH, json_depth, loads_bounded
from rayllm.schema.sampling_params import GuidedSpec

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_OPEN = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's "a tool call follows" token (shown when special tokens are kept)
_NO_ARGS = object()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def call_schema(f: Function) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _arguments(args: Any) -> str | None:
    """A call's arguments as JSON text of an object; None when they are not one (then it is no call)."""
    if isinstance(args, str):
        try:
            value = loads_bounded(args)
        except ValueError:  # malformed, or nested past the bound
            return None
        return args if isinstance(value, dict) else None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def parsed_call(item: Any, *, args_required: bool = False) -> ParsedCall | None:
    """{"name": str, "arguments" | "parameters": object} -> the call; None if it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", _NO_ARGS))
    if args is _NO_ARGS:
        if args_required:
            return None
        args = {}
    arguments = _arguments(args)
    return None if arguments is None else ParsedCall(item["name"], arguments)


@dataclass(frozen=True)
class ToolFormat:
    """A format whose calls sit between an opening text and a closing one (None: the rest of the output), anywhere
    in the answer; once the model opens a call, a grammar keeps its arguments valid."""

    name: str
    open: str
    close: str | None

    def parse(self, body: str) -> list[ParsedCall] | None:
        """The calls in a body (one JSON object, or a list of them); None if it is not a call."""
        try:
            obj = loads_bounded(body.strip())
        except ValueError:  # malformed or nested past the bound: text, not a call
            return None
        calls = [parsed_call(item) for item in (obj if isinstance(obj, list) else [obj])]
        return None if not calls or None in calls else calls  # type: ignore[return-value]

    def structural_tag(self, functions: tuple[Function, ...]) -> str:
        """Free text, but once the model opens a call it must name a function and give valid arguments."""
        if self.close is None:  # one list of calls to the end
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(f) for f in functions]}}
            tags = [{"begin": self.open, "content": {"type": "json_schema", "json_schema": schema}, "end": ""}]
        else:
            tags = [{"begin": f'{self.open}\n{{"name": "{f.name}", "arguments": ',
                     "content": {"type": "json_schema", "json_schema": f.parameters},
                     "end": f"}}\n{self.close}"} for f in functions]
        return json.dumps({"type": "structural_tag",
                           "format": {"type": "triggered_tags", "triggers": [self.open], "tags": tags}})

    def required_spec(self, functions: tuple[Function, ...], parallel: bool) -> GuidedSpec:
        """tool_choice required: a JSON list of calls (parsed as such, whatever the model's own format)."""
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": [call_schema(f) for f in functions]},
                                  "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return GuidedSpec("json_schema", json.dumps(schema), "tool_choice")

    def named_spec(self, f: Function) -> GuidedSpec:
        """tool_choice naming a function: the output is its arguments."""
        return GuidedSpec("json_schema", json.dumps(f.parameters), "tool_choice")

    def named_wrap(self, name: str) -> tuple[str, str]:
        """What a forced call writes around its arguments (named_spec's output): none here."""
        return "", ""


class LlamaJsonFormat(ToolFormat):
    """Llama 3.x's JSON calls: the answer is `[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`."""

    def starts_call(self, head: str) -> bool | None:
        """Whether an answer beginning with `head` (no leading whitespace) is calls; None while it cannot tell."""
        if head.startswith((PYTHON_TAG, "{")):
            return True
        return None if PYTHON_TAG.startswith(head) else False

    def parse(self, body: str) -> list[ParsedCall] | None:
        """`call (; call)*` (a trailing `;` allowed), each a JSON object naming the function and its arguments."""
        text = body.strip()
        text = text[len(PYTHON_TAG):] if text.startswith(PYTHON_TAG) else text
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while True:
            pos = _skip_space(text, pos)
            if pos == len(text) and calls:  # after a trailing `;`
                return calls
            try:
                obj, pos = decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):  # malformed, or nested past the parser's depth
                return None
            call = parsed_call(obj, args_required=True) if json_depth(obj) <= MAX_JSON_DEPTH else None
            if call is None:
                return None
            calls.append(call)
            pos = _skip_space(text, pos)
            if pos == len(text):
                return calls
            if text[pos] != ";":
                return None
            pos += 1

    def complete_calls(self, buf: str, scan: int) -> tuple[list[ParsedCall], int, int]:
        """The calls that a `;` has ended in `buf` (a stream's text so far, from a call's start): the calls,
        how many characters they take (through their `;`) and where to look for the next `;` from. `scan`:
        where the last look ended (a `;` already tried, as it sat inside a string, is not parsed again)."""
        calls: list[ParsedCall] = []
        used = 0
        while (end := buf.find(";", scan)) >= 0:
            scan = end + 1
            found = self.parse(buf[used:end])
            if found is not None:
                calls += found
                used = scan
        return calls, used, scan

    def _tag(self, f: Function) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": "{f.name}", "parameters": ',
                # Whitespace runs bounded: free whitespace lets a small model loop on newlines until max_tokens.
                "content": {"type": "json_schema", "json_schema": f.parameters, "max_whitespace_cnt": 1},
                "end": "}"}

    def _calls(self, functions: tuple[Function, ...], parallel: bool) -> dict[str, Any]:
        return {"type": "tags_with_separator", "tags": [self._tag(f) for f in functions], "separator": "; ",
                "at_least_one": True, "stop_after_first": not parallel}

    def structural_tag(self, functions: tuple[Function, ...]) -> str:
        # Calls from the start, or text in which no call begins (a call later in a text would stay text).
        text = {"type": "any_text", "excludes": ['{"name"']}
        return json.dumps({"type": "structural_tag",
                           "format": {"type": "or", "elements": [self._calls(functions, True), text]}})

    def required_spec(self, functions: tuple[Function, ...], parallel: bool) -> GuidedSpec:
        """tool_choice required: the model's own format, one call or several separated by `; `."""
        return GuidedSpec("structural_tag", json.dumps({"type": "structural_tag",
                                                        "format": self._calls(functions, parallel)}), "tool_choice")

    def named_spec(self, f: Function) -> GuidedSpec:
        return GuidedSpec("structural_tag", json.dumps({"type": "structural_tag", "format": self._tag(f)}),
                          "tool_choice")

    def named_wrap(self, name: str) -> tuple[str, str]:
        return f'{{"name": "{name}", "parameters": ', "}"


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": ToolFormat("hermes", HERMES_OPEN, HERMES_CLOSE),
                                       "mistral": ToolFormat("mistral", MISTRAL_OPEN, None),
                                       "llama3_json": LlamaJsonFormat("llama3_json", PYTHON_TAG, None)}


def detect_tool_format(chat_template: str | None) -> str:
    """The format family a chat template writes; Hermes when it names none (and for templates without tools,
    which get Hermes instructions: tools.inline_tools)."""
    if not chat_template:
        return "hermes"
    if MISTRAL_OPEN in chat_template:
        return "mistral"
    if HERMES_OPEN in chat_template:
        return "hermes"
    # Llama 3.1-3.3 render a call as '{"name": "' + name + '", "parameters": ' + arguments | tojson + '}' and
    # ask for that format in the prompt; 3.1 also knows <|python_tag|>.
    if '"parameters": ' in chat_template or PYTHON_TAG in chat_template:
        return "llama3_json"
    return "hermes"
