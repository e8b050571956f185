"""LoRA adapters through Ray Serve: the HTTP routes with the openai client, and multiplexed routing
with two model replicas (the x-replica-id response header names the replica that served a request)."""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest

from rayllm.serve.lora.adapter_paths import REFUSED
from tests.serve.conftest import ADMIN_KEY, API_KEY
from tests.serve.ops_apps import run_app

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REMOTE_ROOT = "s3://lora-tests/adapters/"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, gguf_path) -> dict[str, str]:
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter
    from rayllm.schema.config import LlamaArch

    arch = read_arch(gguf_path)
    root = tmp_path_factory.mktemp("adapters")
    tiny = LlamaArch(hidden_size=96, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=3, head_dim=16,
                     vocab_size=300, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                     tie_word_embeddings=False)
    paths = {name: random_peft_adapter(str(root / name), arch, rank=8, seed=seed)
             for name, seed in (("pre", 11), ("fresh", 12), ("sticky", 13))}
    paths["big"] = random_peft_adapter(str(root / "big"), arch, rank=16, seed=14, targets=("q_proj",))
    paths["other_base"] = random_peft_adapter(str(root / "other"), tiny, rank=4, seed=15)
    return paths


@pytest.fixture(scope="module")
def lora_server(server, adapters, tmp_path_factory) -> str:
    """A second app on the session's Serve instance: two model replicas with two adapter slots each."""
    from ray import serve

    from rayllm.serve.builder import build_app_with
    from rayllm.serve.config import ServerConfig

    config = ServerConfig.from_args({
        "api_keys": [API_KEY],
        "admin_api_keys": [ADMIN_KEY],
        "engine": {"model": {"dtype": "float32", "max_model_len": 1024},
                   "cache": {"kv_cache_bytes": 48 << 20},
                   "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
                   # The tests' temporary directories hold the adapters clients name (lora_path, load route);
                   # REMOTE_ROOT only for what is refused before any fetch (no S3 here).
                   "lora": {"max_loras": 2, "max_lora_rank": 8, "adapters": {"pre": adapters["pre"]},
                            "allowed_roots": [str(tmp_path_factory.getbasetemp()), REMOTE_ROOT]}},
    })
    yield run_app(server, build_app_with(config, llm_options={"num_replicas": 2}), "lora")
    serve.delete("lora", _blocking=False)


@pytest.fixture(scope="module")
def lclient(lora_server):
    return openai.OpenAI(base_url=f"{lora_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(base: str, route: str, body: dict) -> httpx.Response:
    """The adapter routes need an admin key."""
    return httpx.post(f"{base}/v1/{route}", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=120)


def chat(client, model: str, **kw) -> str:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12, **kw)
    return r.choices[0].message.content


def test_load_use_unload_through_http(lclient, lora_server, adapters, model_name):
    cards = {m.id: m for m in lclient.models.list().data}
    assert set(cards) == {model_name, "pre"}
    assert cards["pre"].parent == model_name and cards[model_name].parent is None
    assert cards["pre"].root == "pre" and adapters["pre"] not in str(lclient.models.list().model_dump())

    base_text = chat(lclient, model_name)
    assert "Paris" in base_text
    pre_text = chat(lclient, f"{model_name}:pre")  # adapter from cluster config, loaded at start
    assert pre_text != base_text

    r = post(lora_server, "load_lora_adapter", {"lora_name": "fresh", "lora_path": adapters["fresh"]})
    assert r.status_code == 200, r.text
    assert "fresh" in {m.id for m in lclient.models.list().data}
    fresh_text = chat(lclient, f"{model_name}:fresh")
    assert fresh_text not in (base_text, pre_text)
    assert chat(lclient, "fresh") == fresh_text  # vLLM's addressing: the adapter's own name
    reply = lclient.completions.create(model=f"{model_name}:fresh", prompt="The capital of France is",
                                       max_tokens=4, temperature=0)
    assert reply.model == f"{model_name}:fresh" and reply.usage.completion_tokens == 4
    # lora_path on the request loads the same files on demand (under its path's name): same tokens.
    assert chat(lclient, model_name, extra_body={"lora_path": adapters["fresh"]}) == fresh_text

    r = post(lora_server, "load_lora_adapter", {"lora_name": "fresh", "lora_path": adapters["fresh"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "lora_adapter_exists"
    assert post(lora_server, "unload_lora_adapter", {"lora_name": "fresh"}).status_code == 200
    with pytest.raises(openai.NotFoundError) as err:
        chat(lclient, f"{model_name}:fresh")
    assert err.value.body["code"] == "model_not_found"
    r = post(lora_server, "unload_lora_adapter", {"lora_name": "fresh"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    with pytest.raises(openai.NotFoundError):
        chat(lclient, f"{model_name}:never-loaded")
    assert chat(lclient, model_name) == base_text


def test_responses_api_names_an_adapter_as_base_colon_name(lclient, model_name):
    """/v1/responses with `model: <base>:<adapter>` answers with the adapter, as chat completions do."""
    r = lclient.responses.create(model=f"{model_name}:pre", input=QUESTION[0]["content"], temperature=0,
                                 max_output_tokens=12)
    assert r.model == f"{model_name}:pre"
    assert r.output_text == chat(lclient, f"{model_name}:pre") != chat(lclient, model_name)


@pytest.mark.parametrize("case, message", [
    ("missing", REFUSED), ("bin", "adapter_model.safetensors"), ("big", "max_lora_rank"),
    ("other_base", "another model"),
])
def test_bad_adapters_are_400_and_the_server_keeps_serving(lclient, lora_server, adapters, tmp_path, case,
                                                           message, model_name):
    path = adapters.get(case, str(tmp_path / "nowhere"))
    if case == "bin":
        import torch

        path = str(tmp_path / "bin")
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
        torch.save({}, tmp_path / "bin" / "adapter_model.bin")
    r = post(lora_server, "load_lora_adapter", {"lora_name": f"bad-{case}", "lora_path": path})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["code"] == "invalid_lora_adapter"
    assert f"bad-{case}" not in {m.id for m in lclient.models.list().data}
    with pytest.raises(openai.BadRequestError):  # the same files named on a request
        chat(lclient, model_name, extra_body={"lora_path": path})
    assert "Paris" in chat(lclient, model_name)


def test_a_remote_root_itself_is_refused_as_a_path_outside_the_roots(lclient, lora_server, model_name, tmp_path):
    """`<root>/` and `<root>//` (which fsspec reads as the root: every adapter under it) and other spellings
    that are no one adapter: the same 400 as a path outside the roots, on a request and on the load route."""
    with pytest.raises(openai.BadRequestError) as err:
        chat(lclient, model_name, extra_body={"lora_path": "/etc"})
    outside = err.value.body
    assert outside["message"] == REFUSED and outside["param"] == "lora_path"
    for path in (REMOTE_ROOT, REMOTE_ROOT + "/", REMOTE_ROOT.rstrip("/"), REMOTE_ROOT + "/x", REMOTE_ROOT + "x/../y"):
        with pytest.raises(openai.BadRequestError) as err:
            chat(lclient, model_name, extra_body={"lora_path": path})
        assert err.value.body == outside, path
        r = post(lora_server, "load_lora_adapter", {"lora_name": "remote", "lora_path": path})
        assert r.status_code == 400 and r.json()["error"] == outside, r.text


def test_adapter_requests_stick_to_the_replica_that_loaded_it(lclient, lora_server, adapters, model_name):
    r = post(lora_server, "load_lora_adapter", {"lora_name": "sticky", "lora_path": adapters["sticky"]})
    assert r.status_code == 200, r.text
    holder = r.headers["x-replica-id"]
    time.sleep(1.0)  # the replica reports its adapters to the Serve controller on a short period

    def served_by(model: str, **kw) -> str:
        kw.setdefault("messages", QUESTION)
        raw = lclient.chat.completions.with_raw_response.create(model=model, temperature=0, max_tokens=2, **kw)
        return raw.headers["x-replica-id"]

    assert [served_by(f"{model_name}:sticky") for _ in range(8)] == [holder] * 8
    assert [served_by("sticky", stream=True) for _ in range(2)] == [holder] * 2
    # Base-model requests carry no multiplexed id: the prefix router spreads prompts that share no prefix
    # block over both replicas (ties at random). Each has its own system message, so its first KV block
    # (16 tokens) is its own. Right after the burst above, the router's view of the holder's queue can
    # lag (until Serve's completion callbacks for the burst have run: seconds on a loaded machine, as in the
    # unload test below), so rounds go on for up to 30 s before the spread must show.
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    for round_ in itertools.count():
        seen |= {served_by(model_name, messages=[{"role": "system", "content": f"Ticket {round_}-{i}: be brief."},
                                                 *QUESTION]) for i in range(8)}
        if len(seen) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(seen) == 2, seen


def test_unloading_an_adapter_mid_stream_ends_its_streams_and_the_replica_serves_on(lclient, lora_server, adapters,
                                                                                     model_name):
    """An admin unloads an adapter while a stream uses it: that stream ends with an error event
    (lora_adapter_unloaded), the unload answers once the slot is free, and the same replica answers
    the next requests (no engine restart)."""
    r = post(lora_server, "load_lora_adapter", {"lora_name": "busy", "lora_path": adapters["fresh"]})
    assert r.status_code == 200, r.text
    holder = r.headers["x-replica-id"]
    base_text = chat(lclient, model_name)
    stream = lclient.chat.completions.create(model=f"{model_name}:busy", messages=QUESTION, temperature=0,
                                             max_tokens=600, stream=True, extra_body={"ignore_eos": True})
    pieces = []
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 3:
                assert post(lora_server, "unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert err.value.body["code"] == "lora_adapter_unloaded"
    assert len(pieces) < 600
    assert chat(lclient, model_name) == base_text
    # Base prompts with their own first KV block go to the least loaded replica (ties broken at random): the
    # holder answers one of them, not replaced. The router counts the ended stream on the holder until
    # Serve's completion callback for it runs, which on a loaded machine has lagged past 9 s (CI, 60 quick
    # requests all to the other replica); meanwhile the other replica takes every request. So the wait is
    # bounded by time (30 s), not by a number of requests.
    served = set()
    deadline = time.monotonic() + 30
    for i in itertools.count():
        if time.monotonic() > deadline:
            break
        raw = lclient.chat.completions.with_raw_response.create(
            model=model_name, messages=[{"role": "system", "content": f"Ticket {i}: be brief."}, *QUESTION],
            temperature=0, max_tokens=2)
        assert raw.parse().choices[0].message.content
        served.add(raw.headers["x-replica-id"])
        if holder in served:
            break
        time.sleep(0.2)
    assert holder in served, served
    assert post(lora_server, "load_lora_adapter", {"lora_name": "busy", "lora_path": adapters["fresh"]}
                ).status_code == 200
