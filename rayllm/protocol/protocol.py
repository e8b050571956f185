"""OpenAI request models (with the vLLM / SGLang extensions users send), validation and conversion.

Every parameter of the reference pages in shared/seeds parses. A parameter this server cannot honour
yet is listed in UNSUPPORTED and refused by check_supported() with a 400 that names it; the few that
OpenAI's convention accepts and ignores are listed in IGNORED. Response models live in rayllm.protocol.responses
and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayllm.protocol.errors import APIError, bad_request, unsupported
from rayllm.protocol.io_struct import StopOptions
from rayllm.protocol.messages import ChatMessage, ContentPart, ResponseFormat, StreamOptions  # noqa: F401  (re-exported)
from rayllm.protocol.request_models import (  # noqa: F401  (re-exported)
    MAX_STOP_SEQUENCES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    compile_regexes,
)
from rayllm.protocol.responses import (  # noqa: F401  (re-exported: the protocol in one import)
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeResponse,
    TopLogprob,
    Usage,
)
from rayllm.schema.sampling_params import SamplingParams

# ---- what works, what is refused -------------------------------------------------------------

# Request field (or chat content-part type) -> why this server refuses it. Features delete their rows.
UNSUPPORTED: dict[str, str] = {
    "custom_logit_processor": "custom logit processors are not run (arbitrary code from clients)",
    "return_routed_experts": "this is a dense model: it has no experts to report",
    "max_dynamic_patch": "this text-only model has no vision patches",
    "min_dynamic_patch": "this text-only model has no vision patches",
    "deep_research": "deep research is not offered by this server",
    "use_beam_search": "beam search is not offered by this server (n and best_of sample instead)",
    "length_penalty": "length_penalty applies to beam search, which this server does not offer",
    "modalities": "this text-only model only answers with text",
    "audio": "audio output is not supported by this text-only model",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not offered by this server",
    # chat content parts, by type
    "image_url": "this text-only model cannot read images",
    "video_url": "this text-only model cannot read video",
    "audio_url": "this text-only model cannot hear audio",
    "input_audio": "this text-only model cannot hear audio",
    "file": "this text-only model cannot read files",
}

# Values of a table entry that ask for nothing new (besides None and the field's default).
_HARMLESS: dict[str, Callable[[Any, SamplingFields], bool]] = {
    "modalities": lambda v, req: v == ["text"],
    "length_penalty": lambda v, req: v == 1.0,  # vLLM's default: asks for nothing
}

# Accepted and ignored, as OpenAI does.
IGNORED = ("user", "safety_identifier", "verbosity", "prompt_cache_key", "request_id", "rid")


# OpenAI's service tiers as engine priorities (lower first): "priority" ahead of the default, "flex"
# (cheaper, slower) behind it. An explicit `priority` wins.
TIER_PRIORITY = {"priority": -1, "flex": 1}


def request_priority(req: SamplingFields) -> int:
    if req.priority is not None:
        return req.priority
    return TIER_PRIORITY.get(req.service_tier or "default", 0)


def check_supported(req: SamplingFields) -> None:
    """Raise a 400 naming the first parameter (or content part) this server cannot honour."""
    fields = type(req).model_fields
    for name, reason in UNSUPPORTED.items():
        if name not in fields:
            continue
        value = getattr(req, name)
        if value is None or value == fields[name].default:
            continue
        harmless = _HARMLESS.get(name)
        if harmless is not None and harmless(value, req):
            continue
        raise unsupported(name, reason)
    for i, msg in enumerate(getattr(req, "messages", None) or []):
        for part in msg.content if isinstance(msg.content, list) else []:
            if part.type in UNSUPPORTED:
                raise APIError(400, f"{part.type} content is not supported: {UNSUPPORTED[part.type]}",
                               param=f"messages.{i}.content", code="unsupported_content")


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs plus the reasoning switches that templates read by name (Qwen3, gpt-oss) and the
    retrieval documents (`documents`, as transformers passes them).

    An explicit chat_template_kwargs entry wins over the top-level field.
    """
    kw = dict(req.chat_template_kwargs or {})
    if req.enable_thinking is not None:
        kw.setdefault("enable_thinking", req.enable_thinking)
    if req.reasoning_effort is not None:
        kw.setdefault("reasoning_effort", req.reasoning_effort)
    if req.documents is not None:
        kw.setdefault("documents", req.documents)
    return kw


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompt(s) as a list: each a string or a list of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        prompts: list[str | list[int]] = [list(p)]  # type: ignore[arg-type]
    else:
        prompts = [x if isinstance(x, str) else list(x) for x in p]  # type: ignore[union-attr]
    for i, x in enumerate(prompts):
        if isinstance(x, list) and (not x or min(x) < 0):
            raise bad_request(f"prompt {i} must be a non-empty list of token ids >= 0", param="prompt")
        if isinstance(x, str) and len(prompts) > 1 and not x:
            raise bad_request(f"prompt {i} is empty", param="prompt")
    return prompts


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` tokens of a prompt (-1: the model's context length;
    None: the prompt whole). Left truncation, so a chat prompt keeps its newest turns and the generation
    prompt."""
    if keep is None:
        return ids
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 (the context length) or at least 1",
                       param="truncate_prompt_tokens", code="invalid_value")
    if keep > max_model_len:
        raise APIError(400, f"truncate_prompt_tokens ({keep}) is greater than the {max_model_len} tokens a prompt "
                       "may hold here (the model's context length): choose a smaller value",
                       param="truncate_prompt_tokens", code="invalid_value")
    keep = max_model_len if keep == -1 else keep
    return ids[-keep:] if len(ids) > keep else ids


def bad_word_variants(words: list[str]) -> list[str]:
    """The texts to tokenize for vLLM's bad_words: each word as written (left-stripped), then with a leading
    space (how it is tokenized mid-sentence)."""
    return [v for w in words for v in (w.lstrip(), " " + w.lstrip())]


def bad_word_ids(encoded: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """bad_word_variants' encodings -> the token sequences to ban, as vLLM picks them: the word as written,
    and its leading-space form when that is another word of as many tokens (not a space token before it)."""
    out: list[tuple[int, ...]] = []
    for plain, spaced in zip(encoded[::2], encoded[1::2], strict=True):
        if not plain:  # only whitespace: nothing to ban (not every space)
            continue
        out.append(tuple(plain))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)


def _requested_max_tokens(req: SamplingFields) -> tuple[str, int | None]:
    """(field name, value): max_completion_tokens wins over max_tokens."""
    mct = getattr(req, "max_completion_tokens", None)
    if mct is not None:
        return "max_completion_tokens", mct
    return "max_tokens", req.max_tokens


def to_sampling_params(req: SamplingFields, *, prompt_len: int, max_model_len: int,
                       eos_token_id: int | None = None) -> SamplingParams:
    """The engine's parameters for one prompt of `prompt_len` tokens (context checks as vLLM words them).

    eos_token_id: for an engine that does not stop on EOS itself; added to stop_token_ids unless ignore_eos.
    """
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"request has {prompt_len} input tokens. Please reduce the length of the input.",
                       param=prompt_param, code="context_length_exceeded")
    room = max_model_len - prompt_len
    name, max_tokens = _requested_max_tokens(req)
    min_tokens = req.min_tokens or 0
    if max_tokens is None:
        max_tokens = room  # the default: whatever the context leaves
        min_tokens = min(min_tokens, max_tokens)
    elif max_tokens > room:
        raise APIError(400, f"'{name}' is too large: {max_tokens}. This model's maximum context length is "
                       f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                       f"({max_tokens} > {max_model_len} - {prompt_len}).", param=name,
                       code="context_length_exceeded")
    elif min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed {name} ({max_tokens})", param="min_tokens")

    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        assert isinstance(req, CompletionRequest)
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None

    stop_ids = list(dict.fromkeys(req.stop_token_ids or ()))
    if eos_token_id is not None and not req.ignore_eos and eos_token_id not in stop_ids:
        stop_ids.append(eos_token_id)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if not req.top_k else req.top_k,  # 0 disables, as in vLLM
            min_p=req.min_p or 0.0,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            seed=req.seed,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items())),
            allowed_token_ids=tuple(req.allowed_token_ids or ()),
            return_hidden_states=bool(req.return_hidden_states),
            priority=request_priority(req),
        )
    except ValueError as exc:  # SamplingParams re-checks its own invariants
        raise bad_request(str(exc)) from None


def stop_options(req: SamplingFields) -> StopOptions:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        regexes = compile_regexes(req.stop_regex)
    except ValueError as exc:  # parsing already checks; kept for requests built without validation
        raise bad_request(f"stop_regex: {exc}", param="stop_regex") from None
    return StopOptions(
        stop=tuple(s for s in dict.fromkeys(stop) if s),  # an empty stop string would match everywhere
        stop_regex=regexes,
        include_stop_str_in_output=bool(req.no_stop_trim or req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        spaces_between_special_tokens=req.spaces_between_special_tokens is not False,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
    )
