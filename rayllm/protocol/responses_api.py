"""OpenAI's Responses API, request side: the body of POST /v1/responses, its input items in a canonical
stored shape, and their conversion into the chat request the server already serves.

Pure protocol (no storage, no Ray). A Responses request becomes a ChatCompletionRequest, so structured
output, tools, reasoning and LoRA go through the chat path unchanged; the generated deltas become
Response objects and semantic events in rayllm.protocol.responses_events.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from rayllm.protocol.conversations import check_metadata
from rayllm.protocol.errors import APIError, bad_request, from_validation_error, unsupported
from rayllm.protocol.limits import MAX_CHAT_TEMPLATE_CHARS, MAX_CONTEXT_CHARS
from rayllm.protocol.messages import Strict
from rayllm.protocol.request_models import ChatCompletionRequest
from rayllm.protocol.structured import check_json_schema
from rayllm.schema.sampling_params import MAX_PRIORITY

MAX_INPUT_ITEMS = 256  # items in one request's `input`
MAX_CONTEXT_ITEMS = 4096  # items of a whole chain (previous responses or a conversation, plus this input)
MAX_TEXT_CHARS = 1 << 20  # one text: instructions, a content part, a function output or its arguments
MAX_PARTS = 64  # content parts of one message
MAX_TOOLS = 128
MAX_ID_CHARS = 128  # ids, call ids and function names sent back by clients
# What one request's item references may bring in (stored items, as JSON): a request body is bounded by
# max_request_bytes, and references must not multiply that past what a whole conversation holds.
MAX_REFERENCED_CHARS = MAX_CONTEXT_CHARS
# Output items a response stored into a conversation may make: room for them is reserved before it runs
# (a turn that would not fit is refused before generating), and a response making more fails.
MAX_TURN_OUTPUT_ITEMS = 16
# The id prefix of each stored item type (OpenAI's); ids are always the server's own.
ITEM_ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Hosted tools of OpenAI's platform that this server does not run (refused by name).
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "computer",
                "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "custom", "apply_patch")
_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64)
    description: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    # Which turns' reasoning the model sees, and OpenAI's reasoning mode: typed by the SDK, checked in
    # check_supported (only what this server does is accepted).
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = Field(None, max_length=64)


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # nothing to obfuscate here; accepted and ignored


class ResponseCreate(Strict):
    model: str | None = Field(None, max_length=256)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    conversation: str | dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    include: list[str] | None = Field(None, max_length=16)
    background: bool | None = False
    truncation: Literal["auto", "disabled"] | None = "disabled"
    prompt: dict[str, Any] | None = None
    # vLLM's extension, as on chat: the request's own template, refused unless the operator allows them
    chat_template: str | None = Field(None, max_length=MAX_CHAT_TEMPLATE_CHARS)
    # accepted and ignored, as OpenAI's convention
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # Scheduling, as on chat (honoured with scheduler.policy: priority): OpenAI's tier, or vLLM's priority
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_metadata(v)

    @field_validator("input")
    @classmethod
    def _input_text(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(v, str) and len(v) > MAX_TEXT_CHARS:
            raise ValueError(f"at most {MAX_TEXT_CHARS} characters")
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        return v


# The errors truncation "auto" answers by dropping the oldest turns: the context, and the server's own bounds.
TOO_LONG = frozenset({"context_length_exceeded", "prompt_too_long", "max_total_tokens_exceeded"})


def turn_starts(messages: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """For truncation "auto": the leading system / developer messages (the instructions: always kept) and
    where each user turn starts after them. Dropping whole turns from the start keeps every tool call with
    its output; the last turn is never dropped."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    return head, [i for i in range(head, len(messages)) if messages[i].get("role") == "user"]


def check_supported(req: ResponseCreate) -> None:
    if req.background:
        raise unsupported("background", "background responses are not offered by this server")
    if req.prompt is not None:
        raise unsupported("prompt", "stored prompt templates are not offered by this server")
    if req.max_tool_calls is not None:
        raise unsupported("max_tool_calls", "built-in tools are not run here, so there is nothing to cap")
    if unknown := sorted(set(req.include or []) - {LOGPROBS_INCLUDE}):  # OpenAI's others need hosted tools, images
        raise bad_request(f"include {', '.join(map(repr, unknown))} is not supported: this server adds only "
                          f"{LOGPROBS_INCLUDE!r}", param="include", code="unsupported_value")
    if req.previous_response_id is not None and req.conversation is not None:
        raise bad_request("use either previous_response_id or conversation, not both", param="previous_response_id")
    reasoning = req.reasoning or ReasoningConfig()
    if reasoning.context == "all_turns":
        raise bad_request("reasoning.context 'all_turns' is not supported: past reasoning items are kept but not "
                          "replayed to the model (chat templates drop earlier turns' thoughts); use 'auto' or "
                          "'current_turn'", param="reasoning.context", code="unsupported_value")
    if reasoning.mode not in (None, "standard"):
        raise bad_request(f"reasoning.mode {reasoning.mode!r} is not supported: this server reasons in the "
                          "'standard' mode only", param="reasoning.mode", code="unsupported_value")


# ---- input items -> canonical stored items -----------------------------------------------------------


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string", param=param)
    if len(value) > MAX_TEXT_CHARS:
        raise bad_request(f"{param} is longer than {MAX_TEXT_CHARS} characters", param=param)
    return value


def _ident(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise bad_request(f"{param} must be a string of 1 to {MAX_ID_CHARS} characters", param=param)
    return value


def _parts_text(content: Any, param: str) -> str:
    """A message's content (a string or text parts) as one text; non-text parts are refused by type."""
    if isinstance(content, str):
        return _text(content, param)
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param=param)
    if len(content) > MAX_PARTS:
        raise bad_request(f"{param} has more than {MAX_PARTS} parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            texts.append(_text(part.get("text"), f"{param}.{j}.text"))
        elif kind == "refusal":
            texts.append(_text(part.get("refusal"), f"{param}.{j}.refusal"))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{kind} content is not supported: this text-only model reads text only",
                           param=f"{param}.{j}.type", code="unsupported_content")
        else:
            raise bad_request(f"{param}.{j}.type must be input_text or output_text, got {kind!r}",
                              param=f"{param}.{j}.type")
    total = "\n".join(texts)  # as chat's text_of (and vLLM): two parts are two lines
    if len(total) > MAX_TEXT_CHARS:
        raise bad_request(f"{param} is longer than {MAX_TEXT_CHARS} characters", param=param)
    return total


def message_item(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = ({"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                            if role == "assistant" else {"type": "input_text", "text": text})
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": role, "status": "completed",
            "content": [part]}


def canonical_item(item: Any, param: str, references: bool = False) -> dict[str, Any]:
    """One input item, checked and bounded, in the shape it is stored and listed in (ids are ours: a client's
    `id` is dropped). With `references`, an item_reference stays {"type": "item_reference", "id"} for
    resolve_references; without, it is refused."""
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object", param=param)
    # OpenAI's ItemReference may omit its type: an object with only an id is one.
    kind = item.get("type") or ("item_reference" if "id" in item and set(item) <= {"id", "type"} else "message")
    if kind == "message":
        role = item.get("role")
        if role not in _INPUT_ROLES:
            raise bad_request(f"{param}.role must be one of {', '.join(_INPUT_ROLES)}", param=f"{param}.role")
        return message_item(role, _parts_text(item.get("content"), f"{param}.content"))
    if kind == "function_call":
        args = _text(item.get("arguments", "{}"), f"{param}.arguments")
        return {"id": new_item_id("fc"), "type": "function_call", "status": "completed",
                "call_id": _ident(item.get("call_id"), f"{param}.call_id"),
                "name": _ident(item.get("name"), f"{param}.name"), "arguments": args}
    if kind == "function_call_output":
        out = item.get("output")
        text = out if isinstance(out, str) else _parts_text(out, f"{param}.output")
        return {"id": new_item_id("fco"), "type": "function_call_output", "status": "completed",
                "call_id": _ident(item.get("call_id"), f"{param}.call_id"), "output": _text(text, f"{param}.output")}
    if kind == "reasoning":  # kept in the record; not replayed (chat templates drop past thoughts)
        content = item.get("content") or []
        return {"id": new_item_id("rs"), "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": _parts_text(content, f"{param}.content")}]}
    if kind == "item_reference":
        if not references:
            raise unsupported(f"{param}", "item references are resolved in /v1/responses input only; send the item")
        return {"type": "item_reference", "id": _ident(item.get("id"), f"{param}.id")}
    raise bad_request(f"{param}.type {kind!r} is not supported (message, function_call, function_call_output "
                      "and reasoning items are)", param=f"{param}.type")


def input_items(req: ResponseCreate) -> list[dict[str, Any]]:
    """The request's input as stored items; item references stay unresolved (resolve_references)."""
    if isinstance(req.input, str):
        return [message_item("user", req.input)]
    return [canonical_item(it, f"input.{i}", references=True) for i, it in enumerate(req.input)]


def reference_ids(items: list[dict[str, Any]]) -> set[str]:
    return {it["id"] for it in items if it["type"] == "item_reference"}


def resolve_references(items: list[dict[str, Any]], known: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each item_reference replaced by a copy of the stored item it names (`known`: id -> item of this
    owner's). The copy gets an id of its own: ids stay unique, so a turn holding it can be stored, and
    listed, like any other. An id not in `known` (missing, or another key's) is a 400 naming input.N.id."""
    out: list[dict[str, Any]] = []
    chars = 0
    for i, it in enumerate(items):
        if it["type"] != "item_reference":
            out.append(it)
            continue
        found = known.get(it["id"])
        if found is None:
            raise bad_request(f"input.{i}.id: no item with id '{it['id']}' found", param=f"input.{i}.id")
        copy = dict(found) | {"id": new_item_id(ITEM_ID_PREFIXES.get(found.get("type", "message"), "msg"))}
        chars += len(json.dumps(copy))
        if chars > MAX_REFERENCED_CHARS:
            raise bad_request(f"the referenced items hold more than {MAX_REFERENCED_CHARS} characters",
                              param="input")
        out.append(copy)
    return out


def turn_output_items(req: ResponseCreate) -> int:
    """Output items one response may make: a reasoning item and a message when no tool can be called (the
    output parser gives the thought, then the answer); MAX_TURN_OUTPUT_ITEMS (enforced) when tools can be:
    parallel calls, and text between them, have no other bound."""
    return 2 if not req.tools or req.tool_choice == "none" else MAX_TURN_OUTPUT_ITEMS


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items (and conversation items) as chat messages: an assistant's calls join its message."""
    messages: list[dict[str, Any]] = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message" and it.get("role") in (*_INPUT_ROLES, "tool"):
            content = it.get("content")
            text = content if isinstance(content, str) else "\n".join(
                p.get("text") or p.get("refusal") or "" for p in content or [] if isinstance(p, dict))
            messages.append({"role": it["role"], "content": text})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last.get("content"):
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": it["call_id"], "content": it.get("output") or ""})
    return messages


# ---- the chat request -----------------------------------------------------------------------------


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    hosted = [t.get("type") for t in tools if isinstance(t, dict) and t.get("type") != "function"]
    if hosted:
        names = ", ".join(sorted({str(h) for h in hosted}))
        raise APIError(400, f"tools of type {names} are not supported: this server runs no hosted tools, "
                       "only function tools that the client executes", param="tools", code="unsupported_tool")
    out = []
    for i, t in enumerate(tools):
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        if "parameters" in fn:
            check_json_schema(fn["parameters"], f"tools.{i}.parameters")
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"tools.{i}.name is required", param=f"tools.{i}.name")
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind in HOSTED_TOOLS or (isinstance(kind, str) and kind.startswith(("web_search", "file_search"))):
        raise APIError(400, f"tool_choice {kind} is not supported: this server runs no hosted tools",
                       param="tool_choice", code="unsupported_tool")
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      param="tool_choice")


def chat_response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema is required for json_schema", param="text.format.schema")
    schema = json.loads(check_json_schema(fmt.schema_, "text.format.schema", exact=True))
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": schema,
                                                   "strict": fmt.strict}}


def wants_logprobs(req: ResponseCreate) -> bool:
    return LOGPROBS_INCLUDE in (req.include or [])


def chat_request(req: ResponseCreate, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates this response (storage is the Responses route's own)."""
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
        "max_completion_tokens": req.max_output_tokens, "stream": req.stream,
        "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": chat_response_format(req.text),
        "reasoning_effort": req.reasoning.effort if req.reasoning else None,
        "logprobs": wants_logprobs(req), "top_logprobs": req.top_logprobs if wants_logprobs(req) else None,
        "user": req.user, "chat_template": req.chat_template,
        "priority": req.priority, "service_tier": req.service_tier,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as exc:  # an item shape the chat messages do not accept: name it as input
        err = from_validation_error(exc)
        param = (err.param or "").replace("messages", "input", 1) or "input"
        raise bad_request(err.message.replace("messages", "input", 1), param=param) from None


def renamed(err: APIError) -> APIError:
    """A chat-path error in this API's field names (max_output_tokens, input)."""
    names = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "messages": "input",
             "response_format": "text.format"}
    param = names.get(err.param or "", err.param)
    message = err.message
    for old, new in names.items():
        message = message.replace(f"'{old}'", f"'{new}'").replace(f"({old})", f"({new})")
    if param == err.param and message == err.message:
        return err  # nothing to rename: the error as raised, whatever it carries (a StorageUnavailable's body)
    out = APIError(err.status_code, message, type=err.type, param=param, code=err.code)
    if hasattr(err, "headers"):
        out.headers = err.headers  # type: ignore[attr-defined]
    return out
