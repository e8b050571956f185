"""vLLM's score and rerank routes on an embedding model: request models, pairing, and response bodies.

The model is a bi-encoder here (the engine pools one vector per text, as for /v1/embeddings), so a pair's
score is the cosine similarity of its two texts' vectors, as vLLM scores with an embedding model. /rerank
takes Jina's and Cohere's shape (query, documents, top_n), /score vLLM's (text_1 against text_2).
"""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field

from rayllm.protocol import limits as L
from rayllm.protocol.embeddings import MAX_INPUTS
from rayllm.protocol.errors import APIError
from rayllm.protocol.messages import Strict

Text = Annotated[str, Field(min_length=1)]
# One text, or a list bounded in length: the bound sits on the list alone (on the union it would cap the
# string's characters as well).
Texts = Text | Annotated[list[Text], Field(max_length=MAX_INPUTS // 2)]


class RerankDocument(Strict):
    text: Text


class RerankRequest(Strict):
    model: str | None = None
    query: Text
    documents: list[Text | RerankDocument] = Field(min_length=1, max_length=MAX_INPUTS - 1)
    top_n: int | None = Field(None, ge=0, le=MAX_INPUTS)  # vLLM: 0 or absent = every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=L.INT32_MAX)
    user: Annotated[str, Field(max_length=256)] | None = None


class ScoreRequest(Strict):
    model: str | None = None
    text_1: Texts
    text_2: Texts
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=L.INT32_MAX)
    user: Annotated[str, Field(max_length=256)] | None = None


def document_texts(req: RerankRequest) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in req.documents]


def score_pairs(req: ScoreRequest) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one text_1 against every text_2, or text_1[i] against text_2[i] (as many of each)."""
    left = [req.text_1] if isinstance(req.text_1, str) else list(req.text_1)
    right = [req.text_2] if isinstance(req.text_2, str) else list(req.text_2)
    if not left or not right:
        raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not left else "text_2")
    if len(left) == 1:
        return left * len(right), right
    if len(left) != len(right):
        raise APIError(400, f"text_1 holds {len(left)} texts and text_2 {len(right)}: give one text_1, or as "
                       "many of each", param="text_2")
    return left, right


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def rerank_body(req: RerankRequest, scores: list[float], request_id: str, model: str, tokens: int) -> dict:
    """Documents by descending score (ties in input order), the first top_n."""
    texts = document_texts(req)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    return {"id": request_id, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "results": [{"index": i, "relevance_score": scores[i]} | ({"document": {"text": texts[i]}}
                                                                     if req.return_documents else {})
                        for i in order]}


def score_body(scores: list[float], request_id: str, model: str, created: int, tokens: int) -> dict:
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
