"""OpenAI chat messages and content parts (every part type parses, so a vision model can be added later)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    # OpenAI answers unknown fields with a 400; so do we.
    model_config = ConfigDict(extra="forbid")


class Loose(BaseModel):
    # Nested objects whose extra keys vary by server (e.g. SGLang's image_url.max_dynamic_patch).
    model_config = ConfigDict(extra="allow")


# ---- content parts --------------------------------------------------------------------------


class ImageURL(Loose):
    url: str
    detail: str | None = None


class MediaURL(Loose):
    url: str


class InputAudio(Loose):
    data: str
    format: str | None = None


class FileRef(Loose):
    file_id: str | None = None
    file_data: str | None = None
    filename: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL
    modalities: str | None = None  # SGLang: "image" | "multi-images" | "video"


class VideoPart(Strict):
    type: Literal["video_url"]
    video_url: MediaURL


class AudioPart(Strict):
    type: Literal["audio_url"]
    audio_url: MediaURL


class InputAudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FilePart(Strict):
    type: Literal["file"]
    file: FileRef


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | AudioPart | InputAudioPart | FilePart, Field(discriminator="type")
]
MessageContent = str | list[ContentPart] | None


# ---- messages -------------------------------------------------------------------------------


class FunctionCall(Loose):
    name: str
    arguments: str


class ToolCall(Loose):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class ChatMessage(Strict):
    role: Role
    content: MessageContent = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    function_call: FunctionCall | None = None  # assistant, deprecated
    reasoning_content: str | None = None  # assistant, reasoning models (SGLang / vLLM)
    reasoning: str | None = None  # the same, by vLLM's current name: each fills the other for the chat template
    # Echoed back by clients that append a previous response message as-is; accepted and ignored.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        # OpenAI's rules: only an assistant turn that calls a tool may omit content.
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            if self.role != "assistant":
                raise ValueError(f"a {self.role} message needs content")
            raise ValueError("an assistant message needs content unless it has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs name")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry tool_calls")
        if self.reasoning_content is None:
            self.reasoning_content = self.reasoning
        elif self.reasoning is None:
            self.reasoning = self.reasoning_content
        return self


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM / SGLang: usage on every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding field; nothing to obfuscate here, ignored


class ResponseFormat(Loose):
    type: Literal["text", "json_object", "json_schema", "structural_tag", "regex", "grammar"]
    json_schema: dict[str, Any] | None = None


# Part types whose text a text-only model reads: chat's, the Responses API's (stored conversation items), refusals.
_TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_of(content: Any) -> str:
    """OpenAI content as text: a string, None (""), or a list of parts whose texts are joined with newlines
    (vLLM's "string" content format: the model reads two parts as two lines, as there).

    A part this text-only model cannot read (an image, audio...) is a ValueError naming its type.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of parts, not {type(content).__name__}")
    parts: list[str] = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        key = _TEXT_KEYS.get(kind) if isinstance(part, dict) else None
        if key is None:
            raise ValueError(f"{kind} content is not supported by this text-only model")
        parts.append(str(part.get(key) or ""))
    return "\n".join(parts)
