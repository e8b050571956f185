"""/v1/embeddings end to end through the OpenAI SDK (`client.embeddings.create`, which decodes base64 with
numpy itself), on the real default model. Reference: transformers' Llama on the same GGUF, its final-norm
hidden state of the last token, normalised (against the model served in fp32: conftest.fp32_client)."""

from __future__ import annotations

import base64
import math

import httpx
import openai
import pytest
import torch

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
