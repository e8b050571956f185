"""GPU faults through the server, shown on CPU: an app whose KV cache holds 384 tokens and whose engine
has the test-only fault injection `debug.fail_step_with_oom_after: 0` (its worker raises
torch.OutOfMemoryError in its first step, as CUDA raises it when a step's activations do not fit).

- A request whose KV need exceeds the whole cache is refused before any step: a 400 naming `max_tokens`.
- The out-of-memory step fails its request with an OpenAI error (503 `out_of_memory`, to retry), and the
  same replica (no restart) serves the next request; the failed step's prompt blocks, hashed when scheduled
  but never computed, are not reused by the prefix cache.
A graceful drain with streams in flight: tests/serve/test_scaling_and_drain.py.
The app serves the tiny Llama of conftest.tiny_models (RANDOM weights, SmolLM2's tokenizer, Llama 3.1's chat template):
none of this depends on what the model says.
"""

from __future__ import annotations

import openai
import pytest

from tests.serve.conftest import API_KEY
from tests.serve.ops_apps import QUESTION, deploy

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

BLOCK, NUM_BLOCKS = 16, 24
MODEL = "tiny-llama"  # the served name of the app's model
ENGINE = {"model": {"served_model_name": MODEL, "dtype": "float32", "max_model_len": 512},
          "cache": {"block_size": BLOCK, "num_blocks_override": NUM_BLOCKS},
          "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256},
          "debug": {"fail_step_with_oom_after": 0}}


@pytest.fixture(scope="module")
def faulty(server, apps, tiny_models):
    from openai import OpenAI
    from ray import serve

    apps.append("faults")
    engine = ENGINE | {"model": ENGINE["model"] | {"model": tiny_models["tiny-llama"]}}
    base = deploy(server, "faults", {"api_keys": [API_KEY], "engine": engine})
    handle = serve.get_deployment_handle("llm", app_name="faults")
    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return client, lambda: handle.engine_stats.remote().result()  # stats(), read off the replica's loop


def replica_actors() -> set[str]:
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::faults#llm#")}


@pytest.mark.parametrize("stream", [False, True])
def test_kv_need_beyond_the_whole_cache_is_a_400_naming_max_tokens(faulty, stream):
    client, stats = faulty
    with pytest.raises(openai.BadRequestError) as caught:
        out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=NUM_BLOCKS * BLOCK,
                                             stream=stream)
        list(out) if stream else None
    err = caught.value
    assert err.param == "max_tokens" and "tokens of KV cache" in err.body["message"], err.body
    assert stats()["num_steps"] == 0  # refused before any step: the injected fault is still to come


def test_out_of_memory_in_a_step_fails_its_request_and_the_replica_serves_on(faulty):
    client, stats = faulty
    replicas = replica_actors()
    assert len(replicas) == 1
    ask = dict(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    # One choice: n choices reach the engine as separate requests, maybe a step apart, and a later one
    # would compute (and validly cache) the prompt before the request is aborted.
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(**ask)  # its first step is the failing one
    err = caught.value
    assert err.status_code == 503 and err.code == "out_of_memory" and err.type == "server_error"
    assert "OutOfMemoryError" in err.body["message"] and "retry" in err.body["message"]
    after = stats()
    assert after["num_steps"] == 1 and after["num_running"] == 0 and after["kv_usage"] == 0.0

    r = client.chat.completions.create(**ask)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # The same prompt's blocks were hashed for the failed step: had the prefix cache kept them, this
    # request would reuse KV that was never written.
    assert r.usage.prompt_tokens > BLOCK and r.usage.prompt_tokens_details.cached_tokens == 0
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(stream=True, **ask) if c.choices)
    assert streamed == r.choices[0].message.content
    assert replica_actors() == replicas and stats()["num_steps"] > 2  # served on by the same engine
