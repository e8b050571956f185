"""/v1/embeddings: the request model, its bounds, and the response body (OpenAI's shape). No Ray, no torch."""

from __future__ import annotations

import base64
import math
import struct
from typing import Annotated, Literal

from pydantic import Field

from rayllm.protocol import limits as L
from rayllm.protocol.errors import APIError
from rayllm.protocol.messages import Strict

# OpenAI's own caps: 2048 inputs per request, 300k tokens over all of them.
MAX_INPUTS = 2048
MAX_TOTAL_TOKENS = 300_000
TokenId = Annotated[int, Field(ge=0, le=L.INT32_MAX)]


class EmbeddingRequest(Strict):
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=L.INT32_MAX)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # vLLM: embed only each input's last k tokens; -1 = as many as one input may hold
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=L.INT32_MAX)] | None = None


def raw_inputs(req: EmbeddingRequest, max_inputs: int) -> list[str | list[int]]:
    """The inputs as texts or token-id lists, bounded in number; an empty input is a 400 (as OpenAI's)."""
    inp = req.input
    if isinstance(inp, str) or (inp and all(isinstance(t, int) for t in inp)):
        items: list = [inp]
    else:
        items = list(inp)
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    cap = min(MAX_INPUTS, max_inputs) if max_inputs else MAX_INPUTS
    if len(items) > cap:
        raise APIError(400, f"input may hold at most {cap} items, got {len(items)}", param="input")
    for item in items:
        if len(item) == 0:
            raise APIError(400, "input must not contain empty strings or empty token lists", param="input")
    return items


def check_tokens(prompts: list[list[int]], per_input: int, vocab_size: int) -> int:
    """Bounds on the tokenized inputs (per input, over all, ids in the vocabulary); the total tokens."""
    total = 0
    for i, ids in enumerate(prompts):
        if not ids:  # a text the tokenizer maps to nothing (a normalizer that strips it): no vector to pool
            raise APIError(400, f"input[{i}] encodes to no tokens", param="input")
        if len(ids) > per_input:
            raise APIError(400, f"input[{i}] has {len(ids)} tokens; at most {per_input} are allowed",
                           param="input", code="context_length_exceeded")
        if max(ids) >= vocab_size:
            raise APIError(400, f"input[{i}] holds a token id outside the vocabulary [0, {vocab_size})",
                           param="input")
        total += len(ids)
    if total > MAX_TOTAL_TOKENS:
        raise APIError(400, f"the inputs hold {total} tokens; at most {MAX_TOTAL_TOKENS} are allowed per request",
                       param="input")
    return total


def shorten(vector: list[float], dimensions: int | None) -> list[float]:
    """`dimensions`: keep the leading components and renormalise to unit length (OpenAI's text-embedding-3)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """base64: the little-endian float32 bytes, which the OpenAI SDK decodes with numpy.frombuffer."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def response_body(vectors: list[list[float]], req: EmbeddingRequest, model: str, prompt_tokens: int) -> dict:
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encode(shorten(v, req.dimensions),
                                                                           req.encoding_format)}
                 for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
