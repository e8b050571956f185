"""/v1/embeddings end to end through the OpenAI SDK (`client.embeddings.create`, which decodes base64 with
numpy itself), on the real default model. Reference: transformers' Llama on the same GGUF, its final-norm
hidden state of the last token, normalised (against the model served in fp32: conftest.fp32_client)."""

from __future__ import annotations

import base64
import math
import time

import httpx
import openai
import pytest
import torch

from tests.serve.ops_apps import ABUSE

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (_norm(a) * _norm(b))


def test_count_dimension_unit_norm_and_base64(client, model_name, hf_model):
    texts = ["The quick brown fox.", "Paris is the capital of France.", "1 2 3"]
    res = client.embeddings.create(model=model_name, input=texts)
    assert [d.index for d in res.data] == [0, 1, 2] and res.model == model_name
    for d in res.data:
        assert len(d.embedding) == hf_model.config.hidden_size
        assert abs(_norm(d.embedding) - 1.0) < 1e-5
    assert res.usage.prompt_tokens == res.usage.total_tokens > len(texts)
    # Asked for explicitly, the SDK hands base64 back as is: little-endian float32, as OpenAI's.
    b64 = client.embeddings.create(model=model_name, input=texts, encoding_format="base64")
    plain = client.embeddings.create(model=model_name, input=texts, encoding_format="float")
    for f, b in zip(plain.data, b64.data, strict=True):
        decoded = torch.frombuffer(bytearray(base64.b64decode(b.embedding)), dtype=torch.float32)
        torch.testing.assert_close(decoded, torch.tensor(f.embedding, dtype=torch.float32), rtol=0, atol=0)
    for d, f in zip(res.data, plain.data, strict=True):  # the SDK's default request (base64, decoded by it)
        torch.testing.assert_close(torch.tensor(d.embedding), torch.tensor(f.embedding), rtol=1e-6, atol=1e-7)


def test_dimensions_truncates_and_renormalises(client, model_name):
    full = client.embeddings.create(model=model_name, input="Truncate me").data[0].embedding
    short = client.embeddings.create(model=model_name, input="Truncate me", dimensions=64).data[0].embedding
    assert len(short) == 64 and abs(_norm(short) - 1.0) < 1e-5
    head = torch.tensor(full[:64])
    torch.testing.assert_close(torch.tensor(short), head / head.norm(), rtol=1e-5, atol=1e-6)


def test_vectors_equal_transformers_pooled_hidden_state(fp32_client, model_name, hf_model, hf_tokenizer):
    prompts = [hf_tokenizer(t).input_ids for t in ["Embeddings from the serving engine.", "A second input " * 20]]
    res = fp32_client.embeddings.create(model=model_name, input=prompts)  # token ids: the very same tokens
    single = fp32_client.embeddings.create(model=model_name, input=prompts[0])  # one list of ids is one input
    assert len(single.data) == 1
    for d, ids in zip(res.data, prompts, strict=True):
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
        h = out.hidden_states[-1][0]
        torch.testing.assert_close(hf_model.lm_head(h), out.logits[0], rtol=1e-4, atol=1e-4)  # post final norm
        ref = h[-1] / h[-1].norm()
        torch.testing.assert_close(torch.tensor(d.embedding), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(single.data[0].embedding), torch.tensor(res.data[0].embedding),
                               rtol=1e-5, atol=1e-5)


def test_paraphrase_is_closer_than_unrelated(client, model_name):
    a, b, c = (d.embedding for d in client.embeddings.create(model=model_name, input=[
        "The cat is sleeping on the sofa.", "A cat sleeps on the couch.", "Quarterly tax filings are due in April."]
    ).data)
    assert _cos(a, b) > _cos(a, c)


@pytest.mark.parametrize("kwargs, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["x"] * 3000}, "input"),
    ({"input": [[1] * 2100]}, "input"),
    ({"input": [[49152]]}, "input"),
    ({"input": "x", "dimensions": 100000}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bounds_are_400s_naming_the_field(client, model_name, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=model_name, **kwargs)
    assert exc.value.body["param"] == param


def test_unknown_model_is_404_and_key_required(client, server):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="x")
    assert httpx.post(f"{server}/v1/embeddings", json={"input": "x"}).status_code == 401


def test_an_adapter_is_refused_naming_the_field(client, model_name):
    """Adapters change generation, not the base model's hidden states: naming one is a 400, not a silent
    base-model vector under the adapter's name."""
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=f"{model_name}:some-adapter", input="x")
    assert exc.value.body["param"] == "model"


QUERY = "Which city is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris.",
        "The sea is deep."]


def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(client, model_name, server, auth):
    """vLLM's /rerank with an embedding model: each document's relevance is the cosine similarity of its
    /v1/embeddings vector and the query's; results by descending score, top_n of them, documents echoed unless
    return_documents is false; /v1/rerank, /v2/rerank and /rerank answer alike."""
    vectors = [d.embedding for d in client.embeddings.create(model=model_name, input=[QUERY, *DOCS]).data]
    want = [_cos(vectors[0], v) for v in vectors[1:]]
    body = {"model": model_name, "query": QUERY, "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]}
    r = httpx.post(f"{server}/v1/rerank", json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5 and x["document"]["text"] == DOCS[x["index"]]
    assert r.json()["usage"]["total_tokens"] > len(DOCS)
    for path in ("/v2/rerank", "/rerank"):
        top = httpx.post(f"{server}{path}", json=body | {"top_n": 2, "return_documents": False}, headers=auth,
                         timeout=60).json()["results"]
        assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and "document" not in top[0]


def test_score_pairs_texts_as_vllm_does(client, model_name, server, auth):
    """vLLM's /score: one text_1 against every text_2, or pair by pair; scores are cosine similarities."""
    vectors = {t: d.embedding for t, d in zip([QUERY, *DOCS],
                                                client.embeddings.create(model=model_name, input=[QUERY, *DOCS]).data,
                                                strict=True)}
    one = httpx.post(f"{server}/v1/score", json={"model": model_name, "text_1": QUERY, "text_2": DOCS},
                     headers=auth, timeout=60).json()
    assert [d["index"] for d in one["data"]] == list(range(len(DOCS))) and one["object"] == "list"
    for d, doc in zip(one["data"], DOCS, strict=True):
        assert d["object"] == "score" and abs(d["score"] - _cos(vectors[QUERY], vectors[doc])) < 1e-5
    pairs = httpx.post(f"{server}/score", json={"model": model_name, "text_1": DOCS[:2], "text_2": DOCS[2:]},
                       headers=auth, timeout=60).json()["data"]
    assert [round(d["score"], 5) for d in pairs] == [round(_cos(vectors[a], vectors[b]), 5)
                                                     for a, b in zip(DOCS[:2], DOCS[2:], strict=True)]
    bad = httpx.post(f"{server}/v1/score", json={"model": model_name, "text_1": DOCS[:2], "text_2": DOCS[:3]},
                     headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    for body, param in (({"query": QUERY, "documents": []}, "documents"),
                        ({"query": QUERY, "documents": ["x"] * 64}, "documents"),
                        ({"query": "", "documents": ["x"]}, "query")):
        r = httpx.post(f"{server}/v1/rerank", json={"model": model_name, **body}, headers=auth, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_score_text_may_be_longer_than_the_list_bound(client, model_name, server, auth):
    """text_1 / text_2 cap a list at 1,024 texts; a single text of more characters than that is one text
    (it was a 400), scored as its /v1/embeddings vector says."""
    long_text = " ".join(DOCS * 40)  # ~5,000 characters, ~1,000 tokens
    assert len(long_text) > 1024
    r = httpx.post(f"{server}/v1/score", json={"model": model_name, "text_1": long_text, "text_2": QUERY},
                   headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    a, b = (d.embedding for d in client.embeddings.create(model=model_name, input=[long_text, QUERY]).data)
    assert abs(r.json()["data"][0]["score"] - _cos(a, b)) < 1e-5


TIMEOUT_S = ABUSE["request_timeout_s"]


@pytest.fixture(scope="module")
def timeout_app(request, shared_apps) -> str:
    """The default model (ops_apps.SMALL_ENGINE) behind a request timeout of TIMEOUT_S: test_abuse.py's app
    (ops_apps.ABUSE; no API keys, so the key these requests carry is not checked), shared."""
    return shared_apps.get(request, "abuse", ABUSE)


def test_request_timeout_bounds_embeddings_and_aborts_their_inputs(timeout_app, model_name, auth, hf_tokenizer):
    """64 inputs of ~1,000 tokens (tens of seconds of prefill here) against a 2 s request timeout: /v1/embeddings
    and /v1/rerank answer 504 request_timeout as generation does, soon after it, and the engine drops the
    inputs (nothing left running or waiting) instead of pooling them for nobody."""
    from ray import serve

    from tests.serve.conftest import API_KEY

    timed = timeout_app
    stats = serve.get_deployment_handle("llm", app_name="abuse").stats
    sdk = openai.OpenAI(base_url=f"{timed}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    ids = hf_tokenizer(" ".join(DOCS * 40)).input_ids[:1000]
    texts = [f"{i} " + " ".join(DOCS * 30) for i in range(63)]
    calls = (lambda: sdk.embeddings.create(model=model_name, input=[[i % 100, *ids[1:]] for i in range(64)]),
             lambda: httpx.post(f"{timed}/v1/rerank", json={"model": model_name, "query": QUERY, "documents": texts},
                                headers=auth, timeout=120))
    for call in calls:
        before = stats.remote().result()["num_steps"]
        t0 = time.monotonic()
        try:
            r = call()
            status, error = r.status_code, r.json()["error"]
        except openai.APIStatusError as exc:
            status, error = exc.status_code, exc.body
        took = time.monotonic() - t0
        assert (status, error["code"], error["type"]) == (504, "request_timeout", "server_error"), error
        assert took < TIMEOUT_S + 5, took
        deadline = time.monotonic() + 10
        while (s := stats.remote().result())["num_running"] + s["num_waiting"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s["num_running"] == s["num_waiting"] == 0, s
        assert s["num_steps"] > before  # it had started on them
    ok = sdk.embeddings.create(model=model_name, input="still serving")  # the engine is free again
    assert len(ok.data[0].embedding) > 0
