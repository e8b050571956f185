"""OpenAI response bodies: chat / completions (whole and streamed), models, vLLM's tokenize routes.

`model_dump()` gives OpenAI's look: keys OpenAI always sends stay (as null when unset: logprobs,
finish_reason, system_fingerprint), while optional extras (reasoning, tool_calls, usage on a
chunk, ...) are left out when None. `model_dump(exclude_none=True)` is also fine for the SDKs.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_serializer, model_validator

from rayllm.protocol.messages import FunctionCall, ToolCall


class OpenAIObject(BaseModel):
    # Keys to leave out of the JSON when they are None (others are always sent, as OpenAI does).
    _omit_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key in self._omit_none:
                if key in data and data[key] is None:
                    del data[key]
        return data


def _now() -> int:
    return int(time.time())


# ---- usage and logprobs ---------------------------------------------------------------------


class PromptTokensDetails(OpenAIObject):
    cached_tokens: int = 0


class Usage(OpenAIObject):
    _omit_none = frozenset({"prompt_tokens_details"})
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIObject):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIObject):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None for the first echoed token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


FinishReason = Literal["stop", "length", "abort", "tool_calls", "function_call", "content_filter"]


# ---- chat -----------------------------------------------------------------------------------


class ChatResponseMessage(OpenAIObject):
    _omit_none = frozenset({"reasoning", "reasoning_content", "tool_calls", "function_call"})
    role: Literal["assistant"] = "assistant"
    content: str | None = ""
    reasoning: str | None = None  # vLLM's name now; reasoning_content (SGLang, older vLLM) carries the same text
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None  # the deprecated functions API

    @model_validator(mode="after")
    def _both_reasoning_names(self) -> ChatResponseMessage:
        if self.reasoning is None:  # the message is built with reasoning_content (ChoiceState.message)
            self.reasoning = self.reasoning_content
        return self


class ChatChoice(OpenAIObject):
    _omit_none = frozenset({"hidden_states", "token_ids"})
    index: int
    message: ChatResponseMessage = Field(default_factory=ChatResponseMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None  # SGLang: the stop string or token id that ended the choice
    hidden_states: list[list[float]] | None = None  # SGLang return_hidden_states: one per output token
    token_ids: list[int] | None = None  # vLLM return_token_ids: the generated tokens


class ChatCompletionResponse(OpenAIObject):
    _omit_none = frozenset({"prompt_token_ids"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM return_token_ids


class DeltaMessage(OpenAIObject):
    _omit_none = frozenset({"role", "content", "reasoning", "reasoning_content", "tool_calls", "function_call"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None


class ChatChunkChoice(OpenAIObject):
    _omit_none = frozenset({"matched_stop", "hidden_states"})
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    hidden_states: list[list[float]] | None = None


class ChatCompletionChunk(OpenAIObject):
    _omit_none = frozenset({"usage", "system_fingerprint"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- completions ----------------------------------------------------------------------------


class CompletionChoice(OpenAIObject):
    _omit_none = frozenset({"hidden_states", "prompt_token_ids", "token_ids"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    hidden_states: list[list[float]] | None = None
    prompt_token_ids: list[int] | None = None  # vLLM return_token_ids: this choice's prompt
    token_ids: list[int] | None = None  # and its generated tokens


class CompletionResponse(OpenAIObject):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChunkChoice(CompletionChoice):
    _omit_none = frozenset({"matched_stop", "hidden_states", "prompt_token_ids", "token_ids"})


class CompletionChunk(OpenAIObject):
    _omit_none = frozenset({"usage", "system_fingerprint"})
    id: str
    object: Literal["text_completion"] = "text_completion"  # OpenAI uses the same name for chunks
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- models and tokenizer routes ------------------------------------------------------------


class ModelCard(OpenAIObject):
    _omit_none = frozenset({"max_model_len"})  # adapters' cards: their base model's card has it
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "rayllm-tp"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(OpenAIObject):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIObject):
    prompt: str
