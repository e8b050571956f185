"""Scale to zero through the real app (Ray Serve, the real model, cluster.yaml's own args with the model
deployment at min_replicas 0 and tight autoscaling delays): probes, scrapes and model listings leave the
model asleep; a chat request to the sleeping model is refused with 503 model_waking + Retry-After while it
wakes (wake_timeout_s is set below its start-up time on purpose) and is then served; the model goes back to
zero after the downscale delay. The autoscaling settings are the ones docs/models-and-scaling.md shows (read
from the page), the delays shortened. The wake-up time is printed (the page records it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.serve.ops_apps import MODEL, SESSION, chat_body, free_port, run_app
from tests.serve.test_shipped_config import CLUSTER_YAML, merge

# The real model on Ray Serve (`make test-fast` skips it), on a Ray instance of its own: mostly probes and
# start-ups, it runs in `make test`'s first pass (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.own_ray]

APP = "zero"
# A probe that woke the model would show within ~2 s: Serve decides at once for a handle that has recorded no
# load (upscale_delay_s 0; the model was never awake here), its control loop adds the replica within 0.5 s, and
# replica_actors() lists a starting actor. 8 s of probes is 4x that, and several turns of the periodic reads a
# probe makes (/health's status read, at most once a second; a listing's wait, at most 2 s).
PROBE_S = 8
DOWNSCALE_S = 2
DOCS = Path(__file__).resolve().parents[2] / "docs" / "models-and-scaling.md"


def documented_autoscaling() -> dict:
    """The model deployment's autoscaling_config that docs/models-and-scaling.md shows for scale to zero."""
    import yaml

    section = DOCS.read_text().split("## Scale to zero", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (llm,) = yaml.safe_load(block)
    assert llm["name"] == "llm"
    return llm["autoscaling_config"]


# The documented settings, with the delays short enough for a test (and the look-back window above the
# metrics interval, as Serve requires).
AUTOSCALING = documented_autoscaling() | {"target_ongoing_requests": 4, "downscale_delay_s": DOWNSCALE_S,
                                          "downscale_to_zero_delay_s": DOWNSCALE_S, "look_back_period_s": 2}


def zero_args() -> dict:
    import yaml

    args = yaml.safe_load(CLUSTER_YAML.read_text())["applications"][0]["args"]
    return merge(args, {
        "replica_num_cpus": 0.5,  # the session app holds the other logical CPUs
        "wake_timeout_s": 1,  # below the model's start-up: the first request sees the bounded wait end
        "engine": {"cache": {"kv_cache_bytes": 64 << 20}},
        "llm_deployment_options": {"autoscaling_config": AUTOSCALING},
    })


def replica_actors() -> list[str]:
    """Model replica actors of the app in any state (starting ones too), from Ray itself."""
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#llm#")]


def running() -> int:
    from ray import serve

    return serve.status().applications[APP].deployments["llm"].replica_states.get("RUNNING", 0)


def read_matches_serve_status() -> bool:
    """The ingress's read of the app's state (model_status: the controller's details, not `serve.status()`)
    says what `serve.status()` says: each deployment's status and running replicas."""
    from ray import serve

    from rayllm.serve.model_status import _read_serve_status, states_of

    ours = {name: (s.status, s.running) for name, s in states_of(_read_serve_status(), APP).items()}
    ref = {name: (d.status.value, d.replica_states.get("RUNNING", 0))
           for name, d in serve.status().applications[APP].deployments.items()}
    return ours == ref and set(ours) == {"ingress", "tokenizer", "llm"}


def settled_read_matches() -> bool:
    """read_matches_serve_status, read again if a replica changed state between the two reads."""
    return any(read_matches_serve_status() for _ in range(5))


@pytest.fixture(scope="module")
def zero(tmp_path_factory) -> str:
    """The app, in this process's Serve instance when the session app runs (conftest.server), else in a Ray
    instance and Serve of its own, stopped after this module."""
    import ray
    from ray import serve

    from rayllm.serve.builder import build_app
    own = "url" not in SESSION
    if own:
        if ray.is_initialized():  # a folder's tensor-parallel Ray (tests/conftest.ray_local) still up
            ray.shutdown()
        port = free_port()
        os.environ["STORAGE_URL"] = f"sqlite:///{tmp_path_factory.mktemp('zero')}/conversations.db"
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
    else:
        base = SESSION["url"]
    try:
        yield run_app(base, build_app(zero_args()), APP, wait_s=120)
    finally:
        if own:
            os.environ.pop("STORAGE_URL", None)
            ray.shutdown()  # the app, its replicas and HAProxy end with this Ray instance
        else:
            serve.delete(APP, _blocking=False)


def test_probes_leave_it_asleep_a_request_wakes_it_and_it_sleeps_again(zero):
    base = zero
    # Asleep from the start (initial_replicas 0), and healthy: a load balancer keeps the ingress in rotation.
    assert replica_actors() == [] and running() == 0
    assert settled_read_matches()
    t_end = time.monotonic() + PROBE_S
    with httpx.Client(timeout=10) as http:
        while time.monotonic() < t_end:
            assert http.get(f"{base}/health").status_code == 200
            m = http.get(f"{base}/metrics")
            assert m.status_code == 200 and "vllm:" in m.text
            assert "vllm:num_requests_running{" not in m.text  # no replica reports: no engine gauges
            models = http.get(f"{base}/v1/models").json()["data"]
            assert [c["id"] for c in models] == [MODEL]
            card = http.get(f"{base}/v1/models/{MODEL}").json()
            assert card["id"] == MODEL and card["object"] == "model"
            assert replica_actors() == [], "a probe, scrape or model listing woke the model"
            time.sleep(0.1)
        assert running() == 0

        # One chat request: the bounded wait (1 s) ends before the replica is up -> 503 + Retry-After.
        t0 = time.monotonic()
        r = http.post(f"{base}/v1/chat/completions", json=chat_body(8), timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_waking" and int(r.headers["retry-after"]) >= 1
        # The client retries as told (sooner here, to time the wake-up); the replica comes up and answers.
        while True:
            r = http.post(f"{base}/v1/chat/completions", json=chat_body(8), timeout=60)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_waking", r.text
            assert time.monotonic() - t0 < 120, "the model did not wake"
        wake_s = time.monotonic() - t0
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["message"]["content"]
        assert len(replica_actors()) == 1 and settled_read_matches()
        print(f"\nwake-up (first request to first answer, model {MODEL}): {wake_s:.2f} s")

        # Awake: /v1/models now reports the model's real context length, read from the replica once.
        assert http.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 8192

        # Back to zero after the downscale delay (plus Serve's control loop and the replica's drain), with
        # /health green throughout.
        t1 = time.monotonic()
        while replica_actors():
            assert http.get(f"{base}/health").status_code == 200
            assert time.monotonic() - t1 < 60, "the model did not scale back to zero"
            time.sleep(0.5)
        print(f"back to zero {time.monotonic() - t1:.1f} s after the answer (downscale_delay_s {DOWNSCALE_S})")
        assert http.get(f"{base}/health").status_code == 200
