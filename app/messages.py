"""OpenAI chat messages and content parts (every part type parses, so a vision model can be added later)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- messages -------------------------------------------------------------------------------


class ImageURL(Loose):
    url: str
    detail: str | None = None


class MediaURL(Loose):
    url: str


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(Strict):
    type: Literal["video_url"]
    video_url: MediaURL


class AudioPart(Strict):
    type: Literal["audio_url"]
    audio_url: MediaURL


class InputAudioPart(Strict):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


ContentPart = Annotated[TextPart | ImagePart | VideoPart | AudioPart | InputAudioPart, Field(discriminator="type")]


class FunctionCall(Loose):
    name: str
    arguments: str


class ToolCall(Loose):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ResponseFormat(Loose):
    type: Literal["text", "json_object", "json_schema", "structural_tag", "regex", "grammar"]
