"""OpenAI request models, with the vLLM / SGLang extensions users send (every seed parameter parses).

Parsing checks types and ranges only; what the server can honour is decided in rayllm.protocol.protocol.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from rayllm.protocol import limits as L
from rayllm.protocol.conversations import check_metadata
from rayllm.protocol.messages import ChatMessage, ResponseFormat, StreamOptions, Strict
from rayllm.schema.sampling_params import MAX_PRIORITY

MAX_STOP_SEQUENCES = L.MAX_STOP_SEQUENCES
TokenId = Annotated[int, Field(ge=0, le=L.INT32_MAX)]
Count = Annotated[int, Field(ge=1, le=L.INT32_MAX)]  # token counts the engine holds in int32
StopField = str | list[str] | None
PathStr = Annotated[str, Field(max_length=L.MAX_PATH_CHARS)]
IdStr = Annotated[str, Field(max_length=L.MAX_ID_CHARS)]


def compile_regexes(patterns: str | list[str] | None) -> tuple[str, ...]:
    """The stop_regex patterns, checked: bounded in number and size, and compiled by RE2 (linear time;
    no backreferences or lookaround, which are what make a backtracking engine's search exponential)."""
    import re2  # google-re2

    rxs = (patterns,) if isinstance(patterns, str) else tuple(patterns or ())
    if len(rxs) > L.MAX_STOP_REGEXES:
        raise ValueError(f"at most {L.MAX_STOP_REGEXES} patterns are allowed, got {len(rxs)}")
    for rx in rxs:
        if len(rx) > L.MAX_STOP_REGEX_CHARS:
            raise ValueError(f"a pattern may have at most {L.MAX_STOP_REGEX_CHARS} characters, got {len(rx)}")
        try:
            re2.compile(rx, re2_options())
        except re2.error as exc:
            reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
            raise ValueError(f"{rx!r} is not a valid RE2 regular expression: {reason}") from None
    return rxs


def re2_options() -> Any:
    import re2

    opts = re2.Options()
    opts.log_errors = False  # a client's bad pattern is a 400, not a line in the server log
    opts.max_mem = 8 << 20  # bounds the compiled program (and so compile time) per pattern
    return opts


def json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str).encode())


# The chat-template rules that /v1/chat/completions and /tokenize share (each model validates its fields with
# them), so that /tokenize takes every chat body and renders it as chat does.

def _tools_size(cls: Any, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if v is not None and json_size(v) > L.MAX_TOOLS_BYTES:
        raise ValueError(f"the tool definitions exceed {L.MAX_TOOLS_BYTES} bytes as JSON")
    for i, tool in enumerate(v or ()):
        if json_size(tool) > L.MAX_SCHEMA_BYTES:
            raise ValueError(f"tool {i} exceeds {L.MAX_SCHEMA_BYTES} bytes as JSON")
    return v


def _kwargs_size(cls: Any, v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is not None and json_size(v) > L.MAX_TEMPLATE_KWARGS_BYTES:
        raise ValueError(f"chat_template_kwargs exceeds {L.MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
    return v


def _continue_needs_assistant(cls: Any, v: bool | None, info: ValidationInfo) -> bool | None:
    messages = info.data.get("messages")
    if v and messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message needs the last message to be from the assistant")
    return v


def _not_both(cls: Any, v: bool | None, info: ValidationInfo) -> bool | None:
    # Runs only when the client sent it; the default gives way to continue_final_message below.
    if v and info.data.get("continue_final_message"):
        raise ValueError("cannot be true together with continue_final_message")
    return v


def _continue_implies_no_prompt(self: Any) -> Any:
    if self.continue_final_message:
        self.add_generation_prompt = False  # continuing the last turn opens no new one
    return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (its spelling since 0.11 of guided_json / guided_regex / guided_choice /
    guided_grammar): one constraint."""

    # `json` on the wire; `json_` here, as BaseModel's own (deprecated) `json` method would be shadowed.
    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[Annotated[str, Field(max_length=L.MAX_GUIDED_CHOICE_CHARS)]] | None = Field(
        None, max_length=L.MAX_GUIDED_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class SamplingFields(Strict):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    # sampling
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=L.INT32_MAX)  # -1 or 0: disabled; above the vocabulary: off
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=L.INT64_MIN, le=L.INT64_MAX)
    # length and stopping
    max_tokens: Count | None = None
    min_tokens: int | None = Field(None, ge=0, le=L.INT32_MAX)
    stop: StopField = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=L.MAX_STOP_TOKEN_IDS)
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = False
    no_stop_trim: bool | None = False  # SGLang's name for include_stop_str_in_output
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    # penalties
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None
    # streaming
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # structured output (rayllm.protocol.structured)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_choice: list[Annotated[str, Field(max_length=L.MAX_GUIDED_CHOICE_CHARS)]] | None = Field(
        None, max_length=L.MAX_GUIDED_CHOICES)
    guided_json: str | dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # SGLang extensions
    # One for every prompt or one per prompt: the prompt-count bound sits on the list alone (on the union it
    # would cap a single string's characters too).
    lora_path: PathStr | Annotated[list[PathStr | None], Field(max_length=L.MAX_PROMPTS)] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # vLLM: a private prefix-cache namespace
    custom_logit_processor: str | None = None
    return_hidden_states: bool | None = False
    return_token_ids: bool | None = False  # vLLM: the prompt's and each choice's token ids in the response
    return_tokens_as_token_ids: bool | None = False  # vLLM: logprobs name each token "token_id:<id>"
    return_routed_experts: bool | None = False
    return_cached_tokens_details: bool | None = False  # "detailed cache hit info": usage always carries it
    # Scheduling (honoured with scheduler.policy: priority): vLLM's priority, lower first; without it
    # OpenAI's service_tier maps to one (protocol.TIER_PRIORITY).
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # accepted and ignored
    user: str | None = Field(None, max_length=L.MAX_ID_CHARS)
    safety_identifier: str | None = Field(None, max_length=L.MAX_ID_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=L.MAX_ID_CHARS)
    request_id: str | None = Field(None, max_length=L.MAX_ID_CHARS)  # vLLM; the server makes its own ids
    # stored with the completion (store: true), bounded as OpenAI bounds it
    metadata: Annotated[dict[str, Any] | None, AfterValidator(check_metadata)] = None
    # vLLM: words never to generate (each with and without a leading space)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=L.MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=L.MAX_BAD_WORDS)
    # vLLM: sample only among these tokens (with any other constraint: the tokens both allow)
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=L.MAX_ALLOWED_TOKEN_IDS)
    # vLLM's beam search: refused by name (rayllm.protocol.protocol.UNSUPPORTED)
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(None, ge=-1e6, le=1e6)
    # vLLM: keep only the prompt's last k tokens (the rendered chat prompt's); -1 = the model's context length
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=L.INT32_MAX)
    rid: IdStr | Annotated[list[IdStr], Field(max_length=L.MAX_PROMPTS)] | None = None  # SGLang; ignored too

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        # The OpenAI SDK merges extra_body into the body itself; raw HTTP clients (seed 004's curl
        # example) send it literally. Its keys win, as in the SDK.
        if isinstance(data, dict) and "extra_body" in data:
            extra = data["extra_body"]
            if extra is not None and not isinstance(extra, dict):
                raise ValueError("extra_body must be a JSON object")
            data = {k: v for k, v in data.items() if k != "extra_body"} | (extra or {})
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):  # as OpenAI and vLLM answer
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: StopField) -> StopField:
        if isinstance(v, list) and len(v) > L.MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {L.MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
        for s in (v,) if isinstance(v, str) else v or ():
            if len(s) > L.MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence may have at most {L.MAX_STOP_CHARS} characters, got {len(s)}")
        return v

    @field_validator("stop_regex")
    @classmethod
    def _stop_regex_compiles(cls, v: str | list[str] | None) -> str | list[str] | None:
        compile_regexes(v)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and len(v) > L.MAX_LOGIT_BIAS:
            raise ValueError(f"at most {L.MAX_LOGIT_BIAS} entries are allowed, got {len(v)}")
        for key, val in (v or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= L.INT32_MAX):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= val <= 100:
                raise ValueError(f"values must be in [-100, 100], got {val} for token {key}")
        return v


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=L.MAX_MESSAGES)
    max_completion_tokens: Count | None = None  # wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # tools (rayllm.protocol.tools)
    tools: list[dict[str, Any]] | None = Field(None, max_length=L.MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = Field(None, max_length=L.MAX_TOOLS)
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    # chat template
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = True
    chat_template: str | None = Field(None, max_length=L.MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: documents for retrieval-augmented templates (transformers' apply_chat_template(documents=...))
    documents: list[dict[str, str]] | None = Field(None, max_length=L.MAX_DOCUMENTS)
    # reasoning
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    enable_thinking: bool | None = None
    separate_reasoning: bool | None = None  # SGLang; default: on when the model or template thinks
    include_reasoning: bool | None = True  # vLLM: False drops the reasoning (neither reasoning_content nor content)
    stream_reasoning: bool | None = None  # SGLang; default on: reasoning streams as it is generated
    deep_research: bool | None = False
    # platform storage (seed 002)
    store: bool | None = False
    store_reasoning: bool | None = False
    conversation: str | dict[str, Any] | None = None
    # other OpenAI parameters
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # vision models (SGLang)
    max_dynamic_patch: int | None = Field(None, ge=1)
    min_dynamic_patch: int | None = Field(None, ge=1)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    _tools_size = field_validator("tools", "functions")(_tools_size)
    _kwargs_size = field_validator("chat_template_kwargs")(_kwargs_size)
    _continue_needs_assistant = field_validator("continue_final_message")(_continue_needs_assistant)
    _not_both = field_validator("add_generation_prompt")(_not_both)
    _continue_implies_no_prompt = model_validator(mode="after")(_continue_implies_no_prompt)

    @field_validator("documents")
    @classmethod
    def _documents_size(cls, v: list[dict[str, str]] | None) -> list[dict[str, str]] | None:
        if v is not None and json_size(v) > L.MAX_DOCUMENTS_BYTES:
            raise ValueError(f"the documents exceed {L.MAX_DOCUMENTS_BYTES} bytes as JSON")
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=5)
    json_schema: str | None = None  # SGLang: a JSON schema as a string

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, v: Any) -> Any:
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > L.MAX_PROMPTS:
            raise ValueError(f"at most {L.MAX_PROMPTS} prompts in one request, got {len(v)}")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_covers_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v < n:
            raise ValueError(f"must be greater than or equal to n ({n}), got {v}")
        return v


class TokenizeRequest(Strict):
    """vLLM's /tokenize: either a prompt or chat messages (rendered as /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=L.MAX_MESSAGES)
    add_special_tokens: bool = True
    continue_final_message: bool = False  # before add_generation_prompt, which defers to it (as in chat)
    add_generation_prompt: bool = True
    chat_template: str | None = Field(None, max_length=L.MAX_CHAT_TEMPLATE_CHARS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=L.MAX_TOOLS)
    return_token_strs: bool = False  # vLLM: also each token's vocabulary entry (`token_strs`)

    _tools_size = field_validator("tools")(_tools_size)
    _kwargs_size = field_validator("chat_template_kwargs")(_kwargs_size)
    _continue_needs_assistant = field_validator("continue_final_message")(_continue_needs_assistant)
    _not_both = field_validator("add_generation_prompt")(_not_both)
    _continue_implies_no_prompt = model_validator(mode="after")(_continue_implies_no_prompt)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request these messages and tools make (unvalidated: both are already), for the tool plan."""
        return ChatCompletionRequest.model_construct(messages=self.messages, tools=self.tools)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=L.MAX_DETOKENIZE_IDS)
