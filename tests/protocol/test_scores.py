"""rayllm.protocol.scores: vLLM's pairing of score texts, and rerank's order, top_n and documents."""

from __future__ import annotations

import pytest

from rayllm.protocol.errors import APIError
from rayllm.protocol.scores import RerankRequest, ScoreRequest, cosine, rerank_body, score_pairs


def test_one_text_1_meets_every_text_2_and_lists_pair_up():
    assert score_pairs(ScoreRequest(text_1="q", text_2=["a", "b"])) == (["q", "q"], ["a", "b"])
    assert score_pairs(ScoreRequest(text_1=["q"], text_2="a")) == (["q"], ["a"])
    assert score_pairs(ScoreRequest(text_1=["x", "y"], text_2=["a", "b"])) == (["x", "y"], ["a", "b"])
    with pytest.raises(APIError) as e:
        score_pairs(ScoreRequest(text_1=["x", "y"], text_2=["a", "b", "c"]))
    assert e.value.param == "text_2"


def test_rerank_sorts_by_score_keeps_ties_in_order_and_cuts_at_top_n():
    req = RerankRequest(query="q", documents=["a", {"text": "b"}, "c", "d"], top_n=3)
    body = rerank_body(req, [0.1, 0.9, 0.1, 0.5], "rerank-1", "m", 12)
    assert [r["index"] for r in body["results"]] == [1, 3, 0]
    assert body["results"][0] == {"index": 1, "relevance_score": 0.9, "document": {"text": "b"}}
    every = rerank_body(req.model_copy(update={"top_n": 0, "return_documents": False}), [0.1, 0.9, 0.1, 0.5],
                        "rerank-1", "m", 12)
    assert [r["index"] for r in every["results"]] == [1, 3, 0, 2] and "document" not in every["results"][0]


def test_cosine_is_scale_free():
    assert cosine([1.0, 0.0], [2.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 3.0]) == pytest.approx(0.0)
    assert cosine([1.0, 1.0], [-1.0, -1.0]) == pytest.approx(-1.0)
