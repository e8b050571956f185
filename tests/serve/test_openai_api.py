"""End to end through Ray Serve with the official openai client and the real default model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module's plain HTTP requests: each new one builds an SSL context (~20 ms of CPU)."""
    with httpx.Client(timeout=60) as client:
        yield client


def test_models_route(client, model_name, server, auth):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    r = httpx.get(f"{server}/v1/models/nope", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_stream_and_non_stream_give_same_greedy_text(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24)
    choice = full.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done_and_continuous_usage(server, auth, model_name):
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(e.get("usage") for e in events)  # continuous_usage_stats: usage on every chunk
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] <= 8
    # As vLLM: usage on every chunk only with the final usage chunk asked for too.
    body["stream_options"] = {"continuous_usage_stats": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
    assert events and not any(e.get("usage") for e in events)
    # stream_options without stream: a 400 naming it (OpenAI's and vLLM's answer).
    r = httpx.post(f"{server}/v1/chat/completions", json=body | {"stream": False}, headers=auth, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_max_tokens_length_and_stop_strings_trimmed(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    full = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24)
    text = full.choices[0].message.content
    stop_word = "Paris"
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                       stop=[stop_word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index(stop_word)]
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                       max_completion_tokens=2)
    assert r.usage.completion_tokens == 2  # max_completion_tokens wins over max_tokens


def test_sampling_params_seed_n_top_k(client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16,
              temperature=1.0, top_p=0.9, seed=7, extra_body={"top_k": 20, "min_p": 0.05})
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    many = client.chat.completions.create(**{**kw, "n": 3, "extra_body": {**kw["extra_body"], "ignore_eos": True}})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) > 1  # each seeded choice draws its own stream
    assert many.usage.completion_tokens == 3 * 16  # usage counts every choice


def test_completions_batched_token_ids_and_echo(client, model_name, server, auth, hf_tokenizer, http):
    prompts = ["The capital of France is", "One, two, three,"]
    r = client.completions.create(model=model_name, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    singles = [client.completions.create(model=model_name, prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in prompts]
    assert [c.text for c in r.choices] == singles
    ids = http.post(f"{server}/tokenize", json={"model": model_name, "prompt": prompts[0]}, headers=auth).json()
    assert ids["count"] == len(ids["tokens"])
    by_ids = client.completions.create(model=model_name, prompt=ids["tokens"], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == singles[0]
    nested = client.completions.create(model=model_name, prompt=[ids["tokens"], ids["tokens"]], max_tokens=6,
                                       temperature=0)
    assert [c.text for c in nested.choices] == [singles[0]] * 2
    echo = client.completions.create(model=model_name, prompt=prompts[0], max_tokens=6, temperature=0, echo=True)
    assert echo.choices[0].text == prompts[0] + singles[0]
    text = http.post(f"{server}/detokenize", json={"model": model_name, "tokens": ids["tokens"]},
                     headers=auth).json()["prompt"]
    assert text == prompts[0]
    vocab = len(hf_tokenizer)  # the tokenizer would decode an unknown id to nothing: a 400 names it instead
    r = http.post(f"{server}/detokenize", json={"model": model_name, "tokens": [ids["tokens"][0], vocab]}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens.1", r.text
    last = http.post(f"{server}/detokenize", json={"model": model_name, "tokens": [vocab - 1]}, headers=auth)
    assert last.status_code == 200 and last.json()["prompt"] == hf_tokenizer.decode([vocab - 1])


async def test_sixteen_concurrent_requests_match_alone(aclient, model_name):
    """Greedy answers of up to 12 tokens: every step of a batch of 16 against the same steps alone, on the
    session app's batch-invariant engine."""
    questions = [f"Give me one fact about the number {i}." for i in range(16)]

    async def ask(q: str) -> str:
        r = await aclient.chat.completions.create(model=model_name, messages=[{"role": "user", "content": q}],
                                                  temperature=0, max_tokens=12)
        return r.choices[0].message.content

    alone = [await ask(q) for q in questions]
    together = await asyncio.gather(*(ask(q) for q in questions))
    assert list(together) == alone


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"temperature": 5}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 100000}, 400, "max_tokens"),
        ({"logit_bias": {"12": 500}}, 400, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi " * 3000}]}, 400, "messages"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"not_a_parameter": 1}, 400, "not_a_parameter"),
        ({"return_routed_experts": True}, 400, "return_routed_experts"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, None),
        ({"messages": []}, 400, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(server, auth, model_name, http, body, status, param):
    payload = {"model": model_name, "messages": QUESTION, "max_tokens": 4} | body
    r = http.post(f"{server}/v1/chat/completions", json=payload, headers=auth)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert param in (err["param"] or "") or param in err["message"]


def test_invalid_json_and_auth(server, auth, model_name):
    r = httpx.post(f"{server}/v1/chat/completions", content=b"{not json",
                   headers=auth | {"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": model_name, "messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server}/health").status_code == 200  # health needs no key


def test_openai_client_raises_typed_errors(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=QUESTION, temperature=9)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=QUESTION)


def test_disconnect_mid_stream_frees_slot_and_blocks(server, auth, model_name, client, llm_stats):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Count to one thousand."}],
            "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
            if got >= 5:
                break  # leaving the block closes the connection mid-stream
    deadline = time.time() + 30
    while time.time() < deadline:
        s = llm_stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0.0:
            break
        time.sleep(0.5)
    assert s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_usage"] == 0.0
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=8)
    assert r.choices[0].message.content


def test_tensor_parallel_2_replica_through_serve(server, tiny_models, auth):
    """A second application whose model replica drives two TP actors in its placement group (all-reduce:
    the shared-memory kernel); it answers as the same model on one rank does (transformers, fp32). The model
    is the tiny Llama with RANDOM weights (ops_apps.tiny_checkpoints; 4 heads, 2 KV heads: one per rank):
    a wrong shard or sum shows in its tokens as it would in the real model's."""
    import ray
    from openai import OpenAI
    from ray import serve

    from rayllm.serve.builder import build_app
    from tests.serve.ops_apps import LLAMA31, TINY_ENGINE
    from tests.serve.test_multi_model import greedy_reference

    api_key = auth["Authorization"].removeprefix("Bearer ")
    allreduce = "shm"
    path = tiny_models[LLAMA31]
    app = build_app({"api_keys": [api_key], "replica_num_cpus": 0.5, "engine": TINY_ENGINE | {
        "model": {"model": path, "served_model_name": LLAMA31, "dtype": "float32", "max_model_len": 256},
        "parallel": {"tensor_parallel_size": 2, "device": "cpu", "cpu": {"allreduce": allreduce}}}})
    serve.run(app, name="tp2", route_prefix="/tp2", blocking=False)
    try:
        tp2 = OpenAI(base_url=f"{server}/tp2/v1", api_key=api_key, max_retries=0, timeout=120)
        deadline = time.time() + 240
        while True:
            try:
                got = tp2.chat.completions.create(model=LLAMA31, messages=QUESTION, temperature=0, max_tokens=16)
                break
            except (openai.APIStatusError, openai.APIConnectionError):
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        assert got.choices[0].message.content == greedy_reference(path, QUESTION, 16)
        handle = serve.get_deployment_handle("llm", app_name="tp2")
        assert handle.stats.remote().result()["num_steps"] > 0
        ranks = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in ray.util.list_named_actors(True)
                 if a["name"].startswith("rayllm-tp:tp2:llm:")]
        used = ray.get([r.__ray_call__.remote(lambda worker: worker.allreduce_backend) for r in ranks])
        assert used == [allreduce] * 2
    finally:
        serve.delete("tp2", _blocking=False)
