"""Tool calling: request fields -> a ToolPlan (what to render, how to constrain, how to parse).

Modes, as OpenAI defines them: `none` (tools are not offered), `auto` (the model may call; its native
format is parsed, and once it opens a call the arguments are grammar-constrained to the function's
schema), `required` (one call, or a list with parallel_tool_calls, guaranteed by a grammar) and a
named function (the output is that function's arguments, guaranteed likewise); the grammars write the
model's own format where it has one (Llama's JSON), else a JSON list of calls / the bare arguments.
With a response format or another guided constraint too, `auto` calls are parsed but not constrained.
Call formats: rayllm.protocol.tool_formats.
The deprecated `functions` / `function_call` map onto the same plan and answer with `function_call`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from rayllm.protocol.errors import bad_request
from rayllm.protocol.limits import loads_bounded
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.structured import check_json_schema
from rayllm.protocol.tool_formats import (
    HERMES_CLOSE,
    HERMES_OPEN,
    TOOL_FORMATS,
    Function,
    ParsedCall,
    ToolFormat,
    detect_tool_format,
)
from rayllm.schema.sampling_params import GuidedSpec

__all__ = ["TOOL_FORMATS", "Function", "ParsedCall", "ToolFormat", "ToolPlan", "detect_tool_format", "inline_tools",
           "new_call_id", "plan_tools", "template_knows_tools"]

ToolMode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    functions: tuple[Function, ...] = ()
    named: str | None = None  # the forced function (mode "named")
    parallel: bool = True
    legacy: bool = False  # functions / function_call: answer with message.function_call
    guided: GuidedSpec | None = None
    template_tools: list[dict[str, Any]] = field(default_factory=list)  # what the chat template is given
    format: ToolFormat = TOOL_FORMATS["hermes"]  # how the model writes calls


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _function(spec: Any, where: str) -> Function:
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object", param=where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}", param=where)
    params = spec.get("parameters", EMPTY_PARAMETERS)
    parameters = json.loads(check_json_schema(params, f"{where}.parameters"))
    desc = spec.get("description")
    return Function(name, desc if isinstance(desc, str) else None, parameters)


def _functions(req: ChatCompletionRequest) -> tuple[tuple[Function, ...], bool]:
    if req.tools and req.functions:
        raise bad_request("send either tools or the deprecated functions, not both", param="functions")
    if req.functions:
        return tuple(_function(f, f"functions.{i}") for i, f in enumerate(req.functions)), True
    out = []
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"tools.{i}.type must be 'function'", param=f"tools.{i}.type")
        out.append(_function(tool.get("function"), f"tools.{i}.function"))
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    return tuple(out), False


def _choice(req: ChatCompletionRequest, legacy: bool) -> tuple[ToolMode, str | None]:
    choice = req.function_call if legacy else req.tool_choice
    param = "function_call" if legacy else "tool_choice"
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        return choice, None  # type: ignore[return-value]
    if not legacy and not isinstance(choice.get("function"), dict):  # a str or list here: a 400, not a 500
        raise bad_request("tool_choice.function must be an object naming a function", param=param)
    name = choice.get("name") if legacy else choice["function"].get("name")
    if not legacy and choice.get("type", "function") != "function":
        raise bad_request("tool_choice.type must be 'function'", param=param)
    if not isinstance(name, str):
        raise bad_request(f"{param} must be 'none', 'auto', 'required' or name a function", param=param)
    return "named", name


def plan_tools(req: ChatCompletionRequest, *, other_constraint: bool, tool_format: str = "hermes") -> ToolPlan | None:
    """None when the request offers no tools. other_constraint: response_format & co. are set too.

    tool_format: the model's call format family (TOOL_FORMATS): how calls are parsed and what the grammars write.
    """
    fmt = TOOL_FORMATS[tool_format]
    functions, legacy = _functions(req)
    mode, named = _choice(req, legacy)
    if not functions:
        if mode in ("required", "named"):
            param = "function_call" if legacy else "tool_choice"
            raise bad_request(f"{param} '{named or mode}' needs {'functions' if legacy else 'tools'}", param=param)
        return None
    if mode == "none":
        return ToolPlan("none", functions, legacy=legacy)
    by_name = {f.name: f for f in functions}
    if named is not None and named not in by_name:
        raise bad_request(f"tool_choice names '{named}', which is not among the tools", param="tool_choice")
    if mode in ("required", "named") and other_constraint:
        raise bad_request(f"tool_choice '{named or mode}' cannot be combined with response_format or a guided "
                          f"constraint", param="tool_choice")
    if mode in ("required", "named"):  # the grammar promises these arguments: what it cannot enforce is a 400
        for i, f in enumerate(functions):
            if mode == "required" or f.name == named:
                where = f"functions.{i}.parameters" if legacy else f"tools.{i}.function.parameters"
                check_json_schema(f.parameters, where, exact=True)
    parallel = req.parallel_tool_calls is not False and not legacy
    template_tools = [f.to_tool() for f in functions]
    if mode == "named":
        spec = fmt.named_spec(by_name[named])  # type: ignore[index]
        return ToolPlan("named", functions, named, parallel, legacy, spec, template_tools, fmt)
    if mode == "required":
        return ToolPlan("required", functions, None, parallel, legacy, fmt.required_spec(functions, parallel),
                        template_tools, fmt)
    spec = None if other_constraint else GuidedSpec("structural_tag", fmt.structural_tag(functions), "tools")
    return ToolPlan("auto", functions, None, parallel, legacy, spec, template_tools, fmt)


# ---- prompting a template that does not know tools --------------------------------------------------


def hermes_system_prompt(tools: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You may call one or more functions to assist with the user "
            "query. Here are the available functions:\n<tools>\n" + listing + "\n</tools>\n"
            "For each function call, return a JSON object with the function name and arguments within "
            f'{HERMES_OPEN}{HERMES_CLOSE} tags:\n{HERMES_OPEN}\n{{"name": <function-name>, "arguments": '
            f"<args-json-object>}}\n{HERMES_CLOSE}")


def hermes_call_text(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments)
        except ValueError:
            pass  # malformed or too deep to re-serialize: the client's text as it is
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system prompt, calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) or []
        fc = m.pop("function_call", None)
        if fc:
            calls = [*calls, {"function": fc}]
        if calls:
            texts = [hermes_call_text(c["function"]["name"], c["function"].get("arguments", {})) for c in calls]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *texts]))
        if m.get("role") in ("tool", "function"):
            m = {"role": "tool", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        prompt = hermes_system_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_knows_tools(template: str) -> bool:
    return "tools" in template and ("tool_calls" in template or "tool_call" in template)
