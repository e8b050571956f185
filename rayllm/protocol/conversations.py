"""Conversations in OpenAI's shapes: request bodies, chat message <-> conversation item, history merging.

Pure protocol (no storage, no Ray): the ingress reads and writes rows through
rayllm.serve.stores.conversation_store and converts with these functions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from rayllm.protocol.errors import bad_request
from rayllm.protocol.limits import MAX_CONTEXT_CHARS
from rayllm.protocol.messages import Strict, text_of

MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_ROLES = ("user", "assistant", "system", "developer", "tool")
# What one conversation may hold (its whole history is loaded, rendered and sent with each turn that uses it).
MAX_CONVERSATION_ITEMS = 4096
MAX_CONVERSATION_CHARS = MAX_CONTEXT_CHARS  # its items, as stored JSON


def check_metadata(v: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's bounds on `metadata` (conversations, Responses, stored chat completions)."""
    if v is None:
        return v
    if len(v) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(v)}")
    for key, val in v.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(val, str) or len(val) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"values must be strings of at most {MAX_METADATA_VALUE_CHARS} characters")
    return v


class ConversationCreate(Strict):
    items: list[dict[str, Any]] | None = Field(None, max_length=20)
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_metadata(v)


class ConversationUpdate(Strict):
    metadata: dict[str, Any]

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, Any]) -> dict[str, Any] | None:
        return check_metadata(v)


class ItemsCreate(Strict):
    items: list[dict[str, Any]] = Field(min_length=1, max_length=20)


class ItemsQuery(BaseModel):  # query strings: unknown keys (the SDK's `include`) are ignored, as OpenAI does
    limit: int = Field(20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None


def conversation_id(value: str | dict[str, Any] | None) -> str | None:
    """The request's `conversation`: an id, or an object carrying one."""
    if value is None:
        return None
    cid = value.get("id") if isinstance(value, dict) else value
    if not isinstance(cid, str) or not cid:
        raise bad_request("conversation must be a conversation id or an object with an `id`", param="conversation")
    return cid


def message_item(role: str, content: Any) -> dict[str, Any]:
    """A stored message item (no id yet): input_text for what came in, output_text for the assistant."""
    text = text_of(content)
    if role == "assistant":
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    else:
        part = {"type": "input_text", "text": text}
    return {"type": "message", "role": role, "status": "completed", "content": [part]}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def history_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items as chat messages (reasoning items are kept, not replayed: templates drop them anyway)."""
    return [{"role": it["role"], "content": text_of(it.get("content"))}
            for it in items if it.get("type", "message") == "message" and it.get("role") in _ROLES]


def with_history(history: list[dict[str, Any]], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's leading system/developer messages, then the stored history, then the rest."""
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    return messages[:head] + history + messages[head:]


def turn_items(last_input: dict[str, Any], answer: str, reasoning: str | None) -> list[dict[str, Any]]:
    """What `store: true` keeps: the latest input message, [the reasoning], the assistant's answer."""
    items = [message_item(last_input.get("role", "user"), last_input.get("content"))]
    if reasoning:
        items.append(reasoning_item(reasoning))
    items.append(message_item("assistant", answer))
    return items


def items_page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def check_room(conversation_id: str, count: int, chars: int, add_count: int, add_chars: int) -> None:
    """A 400 when a conversation holding `count` items (`chars` of JSON) cannot take `add_count` more."""
    if count + add_count > MAX_CONVERSATION_ITEMS or chars + add_chars > MAX_CONVERSATION_CHARS:
        raise bad_request(f"conversation {conversation_id} is full: it holds {count} items ({chars} characters); "
                          f"at most {MAX_CONVERSATION_ITEMS} items and {MAX_CONVERSATION_CHARS} characters are "
                          "allowed: start a new conversation", param="conversation", code="conversation_full")
