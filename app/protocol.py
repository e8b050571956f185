"""OpenAI request models (with the vLLM / SGLang extensions users send), validation and conversion.

Every parameter of the reference pages in shared/seeds parses. A parameter this server cannot honour
yet is listed in UNSUPPORTED and refused with a 400 that names it; the few that OpenAI's convention
accepts and ignores are listed in IGNORED.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from app.errors import APIError
from app.messages import ChatMessage, ResponseFormat, StreamOptions, Strict
from model_parallel.sampling_params import SamplingParams

# ---- shared sampling fields -----------------------------------------------------------------

StopField = str | list[str] | None


class SamplingFields(Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(1, ge=1, le=128)
    seed: int | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    include_stop_str_in_output: bool | None = False
    stop_regex: str | list[str] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    guided_choice: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    lora_path: str | None = None
    custom_logit_processor: str | None = None
    return_hidden_states: bool | None = False
    return_routed_experts: bool | None = False
    return_cached_tokens_details: bool | None = False
    user: str | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    request_id: str | None = None
    rid: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, v: StopField) -> StopField:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, val in (v or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= val <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {val}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        return -1 if v == 0 else v  # 0 means disabled, as in vLLM


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    store: bool | None = False
    store_reasoning: bool | None = False
    conversation: str | dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    enable_thinking: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    deep_research: bool | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    continue_final_message: bool | None = False
    add_generation_prompt: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            # vLLM's rule; continue_final_message implies no new assistant turn.
            self.add_generation_prompt = False
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=5)
    json_schema: str | None = None

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise ValueError("best_of must be greater than or equal to n")
        return self


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


# ---- what works, what is refused -------------------------------------------------------------

# field -> why it is refused. Later features delete their rows.
UNSUPPORTED: dict[str, str] = {
    "response_format": "structured output (json_object / json_schema) is not available yet",
    "regex": "regex-constrained decoding is not available yet",
    "ebnf": "grammar-constrained decoding is not available yet",
    "json_schema": "schema-constrained decoding is not available yet",
    "guided_choice": "guided decoding is not available yet",
    "guided_json": "guided decoding is not available yet",
    "guided_regex": "guided decoding is not available yet",
    "guided_grammar": "guided decoding is not available yet",
    "tools": "tool calling is not available yet",
    "functions": "function calling is not available yet",
    "function_call": "function calling is not available yet",
    "lora_path": "LoRA adapters are not available yet",
    "custom_logit_processor": "custom logit processors are not accepted (arbitrary code)",
    "return_hidden_states": "hidden states are not returned yet",
    "return_routed_experts": "this is a dense model: it has no experts to report",
    "suffix": "this model has no fill-in-the-middle tokens",
    "max_dynamic_patch": "this text-only model has no vision patches",
    "min_dynamic_patch": "this text-only model has no vision patches",
    "store": "conversation storage is not available yet",
    "store_reasoning": "conversation storage is not available yet",
    "conversation": "conversation storage is not available yet",
    "separate_reasoning": "reasoning parsing is not available yet",
    "stream_reasoning": "reasoning parsing is not available yet",
    "deep_research": "deep research is not offered by this server",
    "audio": "audio output is not supported by this text-only model",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not offered by this server",
    "best_of": "best_of > n is not available yet",
}
# Accepted and ignored, as OpenAI does.
IGNORED = ("user", "metadata", "service_tier", "safety_identifier", "verbosity", "prompt_cache_key")
_DEFAULTS_OK: dict[str, Any] = {"store": False, "store_reasoning": False, "return_hidden_states": False,
                                "return_routed_experts": False, "separate_reasoning": False,
                                "stream_reasoning": False, "deep_research": False}


def check_supported(req: SamplingFields) -> None:
    """Raise a 400 naming the first parameter this server cannot honour."""
    for name, reason in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is None or value == _DEFAULTS_OK.get(name, object()):
            continue
        if name == "response_format" and value.type == "text":
            continue
        if name == "best_of" and value == (req.n or 1):
            continue
        raise APIError(400, f"`{name}` is not supported: {reason}", param=name, code="unsupported_parameter")
    if isinstance(req, ChatCompletionRequest):
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "`tool_choice` is not supported: tool calling is not available yet",
                           param="tool_choice", code="unsupported_parameter")
        if req.modalities not in (None, ["text"]):
            raise APIError(400, "only the text modality is supported", param="modalities")
        for i, m in enumerate(req.messages):
            for part in m.content if isinstance(m.content, list) else []:
                if part.type != "text":
                    raise APIError(400, f"{part.type} content is not supported by this text-only model",
                                   param=f"messages.{i}.content", code="unsupported_content")


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs plus the reasoning switches that templates read by name."""
    kw = dict(req.chat_template_kwargs or {})
    if req.enable_thinking is not None:
        kw.setdefault("enable_thinking", req.enable_thinking)
    if req.reasoning_effort is not None:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    return kw


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    out = list(p)
    if any((isinstance(x, str) and x == "") or (isinstance(x, list) and not x) for x in out):
        raise APIError(400, "prompt must not contain empty entries", param="prompt")
    return out  # type: ignore[return-value]


def to_sampling_params(req: SamplingFields, *, prompt_len: int, max_model_len: int) -> SamplingParams:
    is_chat = isinstance(req, ChatCompletionRequest)
    prompt_param = "messages" if is_chat else "prompt"
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"request has {prompt_len} input tokens. Please reduce the length of the input.",
                       param=prompt_param, code="context_length_exceeded")
    room = max_model_len - prompt_len
    max_tokens = req.max_completion_tokens if is_chat and req.max_completion_tokens else req.max_tokens
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
                       f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                       f"({max_tokens} > {max_model_len} - {prompt_len}).", param="max_tokens",
                       code="context_length_exceeded")
    if is_chat:
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens,
            min_tokens=min(req.min_tokens or 0, max_tokens),
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items())),
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


@dataclass(frozen=True)
class StopOptions:
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def stop_options(req: SamplingFields) -> StopOptions:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    regexes = (req.stop_regex,) if isinstance(req.stop_regex, str) else tuple(req.stop_regex or ())
    for rx in regexes:
        try:
            re.compile(rx)
        except re.error as exc:
            raise APIError(400, f"stop_regex {rx!r} is not a valid regular expression: {exc}",
                           param="stop_regex") from None
    return StopOptions(
        stop=tuple(s for s in stop if s),
        stop_regex=regexes,
        include_stop_str_in_output=bool(req.no_stop_trim or req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
    )
