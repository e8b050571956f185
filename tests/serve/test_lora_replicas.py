"""Runtime-loaded LoRA adapters with two ingress replicas (rayllm/serve/lora/shared_adapters.py): an
adapter loaded through one replica serves through the other, an unload reaches both within the stated
bound, two loads of one name at once leave exactly one winner, and restarted replicas still serve it. The
model runs two replicas too: an unload reaches both, and a reload reads the files again.

Each ingress replica serves HTTP on a port of its own (HAProxy balances over them): the tests call each
replica there, so which one answers is the test's choice, not the balancer's.

The model is the tiny Llama with RANDOM weights (ops_apps.tiny_checkpoints) and its adapters random too:
what is checked is which files answer where (an adapter's tokens against the base model's and another
adapter's), not what they say."""

from __future__ import annotations

import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from rayllm.serve.lora.shared_adapters import FRESH_S
from tests.serve.conftest import ADMIN_KEY, API_KEY
from tests.serve.ops_apps import LLAMA31, QUESTION, SESSION, TINY_ENGINE, run_app, wait_healthy

pytestmark = pytest.mark.slow  # Ray Serve: `make test-fast` skips it

APP = "lorarep"
BASE = LLAMA31  # the app's model: the tiny random Llama


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_models) -> dict[str, str]:
    """Random PEFT adapters on the tiny Llama, as tests/serve/test_lora_serving.py makes them on the default model."""
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    arch = read_arch(tiny_models[BASE])
    root = tmp_path_factory.mktemp("replica-adapters")
    return {name: random_peft_adapter(str(root / name), arch, rank=8, seed=seed)
            for name, seed in (("one", 21), ("two", 22), ("three", 23))}


def ingress_targets() -> dict[str, str]:
    """The app's running ingress replicas: each one's actor name -> its own HTTP URL (route prefix included),
    as Serve's controller gives them to HAProxy."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    groups = ray.get(_get_global_client()._controller.get_target_groups.remote(APP, True))
    host = urlsplit(SESSION["url"]).hostname  # replicas listen on http_options.host, not the node's address
    return {t.name: f"http://{host}:{t.port}/{APP}" for g in groups if g.protocol == RequestProtocol.HTTP
            for t in g.targets}


def two_replicas(old: frozenset[str] = frozenset(), wait_s: float = 120) -> list[str]:
    """The URLs of two running ingress replicas, none of them one of `old` (actor names), once healthy."""
    deadline = time.monotonic() + wait_s
    while True:
        targets = {name: url for name, url in ingress_targets().items() if name not in old}
        if len(targets) == 2:
            return [wait_healthy(url) for url in sorted(targets.values())]
        assert time.monotonic() < deadline, f"ingress replicas running: {sorted(ingress_targets())}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def replicas(server, adapters, tiny_models, tmp_path_factory) -> list[str]:
    """An app whose ingress runs two replicas (two model replicas, two adapter slots each); the session's
    STORAGE_URL is its store. The list is the test module's to update when replicas are replaced."""
    from ray import serve

    from rayllm.serve.builder import build_app_with
    from rayllm.serve.config import ServerConfig

    config = ServerConfig.from_args({
        "api_keys": [API_KEY], "admin_api_keys": [ADMIN_KEY], "replica_num_cpus": 0.5,
        "engine": TINY_ENGINE | {
            "model": {"model": tiny_models[BASE], "served_model_name": BASE, "dtype": "float32", "max_model_len": 256},
            "lora": {"max_loras": 2, "max_lora_rank": 8, "allowed_roots": [str(tmp_path_factory.getbasetemp())]}},
    })
    ingress = build_app_with(config, {"num_replicas": 2})._bound_deployment  # the builder's app, its ingress on two replicas
    app = ingress.options(num_replicas=2).bind(*ingress.init_args, **ingress.init_kwargs)
    run_app(server, app, APP)
    yield two_replicas()
    serve.delete(APP, _blocking=False)


def admin(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120)


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                      json={"model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0})


def text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def listed(url: str) -> list[str]:
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def test_an_adapter_loaded_through_one_replica_serves_through_the_other_until_unloaded(replicas, adapters):
    a, b = replicas
    base = text(chat(b, BASE))
    r = admin(a, "load_lora_adapter", {"lora_name": "one", "lora_path": adapters["one"]})
    assert r.status_code == 200, r.text
    # b never saw the load: it finds the adapter in the store at once (embeddings: refused as an adapter,
    # the base model's vector is not the adapter's; before any chat there taught b the name)
    r = httpx.post(f"{b}/v1/embeddings", json={"model": "one", "input": "x"},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    one = text(chat(b, "one"))
    assert one != base and text(chat(b, f"{BASE}:one")) == one == text(chat(a, "one"))
    assert listed(b).count("one") == 1
    card = httpx.get(f"{b}/v1/models/one", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()
    assert card["parent"] == BASE and adapters["one"] not in str(card)

    r = admin(b, "unload_lora_adapter", {"lora_name": "one"})
    assert r.status_code == 200, r.text
    unloaded = time.monotonic()
    assert chat(b, "one").status_code == 404  # the replica that unloaded: at once
    assert "one" not in listed(a)  # /v1/models reads the store every time
    # The other replica served "one" a moment ago: it may do so from its view for up to FRESH_S more.
    while (r := chat(a, "one")).status_code == 200:
        assert time.monotonic() - unloaded < FRESH_S + 1
        time.sleep(0.1)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert time.monotonic() - unloaded < FRESH_S + 1
    r = admin(a, "unload_lora_adapter", {"lora_name": "one"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
    assert text(chat(a, BASE)) == base


def test_two_loads_of_one_name_at_once_through_both_replicas_one_wins(replicas, adapters):
    """vLLM's answer for a taken name (400 lora_adapter_exists) for exactly one of them, whichever replica
    took it; both replicas then serve the winner's files."""
    start = threading.Barrier(2)
    answers: dict[int, httpx.Response] = {}

    def load(i: int, url: str, path: str) -> None:
        start.wait()
        answers[i] = admin(url, "load_lora_adapter", {"lora_name": "two", "lora_path": path})

    threads = [threading.Thread(target=load, args=(i, url, adapters[name]))
               for i, (url, name) in enumerate(zip(replicas, ("two", "three"), strict=True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(r.status_code for r in answers.values()) == [200, 400], [r.text for r in answers.values()]
    (lost,) = [r for r in answers.values() if r.status_code == 400]
    assert (lost.json()["error"]["code"], lost.json()["error"]["param"]) == ("lora_adapter_exists", "lora_name")
    (won,) = [i for i, r in answers.items() if r.status_code == 200]
    served = {text(chat(url, "two")) for url in replicas}
    assert len(served) == 1 and all(listed(url).count("two") == 1 for url in replicas)
    # The winner's files: the same text as that adapter under a name of its own.
    winner = ("two", "three")[won]
    assert admin(replicas[0], "load_lora_adapter", {"lora_name": "check", "lora_path": adapters[winner]}
                 ).status_code == 200
    assert text(chat(replicas[1], "check")) == served.pop() != text(chat(replicas[1], BASE))
    for name in ("two", "check"):
        assert admin(replicas[1], "unload_lora_adapter", {"lora_name": name}).status_code == 200


def held(name: str) -> int:
    """How many model replicas hold adapter `name` (each replica's own registry, asked through Serve)."""
    from ray import serve

    cards = serve.get_deployment_handle("llm", APP).broadcast("lora_adapters").results(timeout_s=60)
    assert len(cards) == 2
    return sum(any(a["name"] == name for a in c["adapters"]) for c in cards)


def test_an_unload_reaches_every_model_replica_and_a_reload_reads_the_files_again(replicas, adapters, tmp_path):
    """Serve may have sent an adapter's requests to both model replicas: the unload (routed through either
    ingress replica) drops it on both, and a reload of the same name and path serves the files as they are
    now (the same text as those files under a name of their own), on whichever replica serves it."""
    import shutil

    from ray import serve

    a, b = replicas
    path = shutil.copytree(adapters["one"], tmp_path / "swap")
    assert admin(a, "load_lora_adapter", {"lora_name": "swap", "lora_path": str(path)}).status_code == 200
    before = text(chat(a, "swap"))
    serve.get_deployment_handle("llm", APP).broadcast("load_lora_adapter", "swap", str(path)).results(timeout_s=120)
    assert held("swap") == 2
    shutil.rmtree(path)
    shutil.copytree(adapters["two"], path)  # new files at the same path
    assert admin(b, "unload_lora_adapter", {"lora_name": "swap"}).status_code == 200
    assert held("swap") == 0
    assert admin(a, "load_lora_adapter", {"lora_name": "swap", "lora_path": str(path)}).status_code == 200
    assert admin(a, "load_lora_adapter", {"lora_name": "ref", "lora_path": adapters["two"]}).status_code == 200
    after = {text(chat(url, "swap")) for url in replicas}
    assert after == {text(chat(b, "ref"))} and before not in after
    for name in ("swap", "ref"):
        assert admin(a, "unload_lora_adapter", {"lora_name": name}).status_code == 200
    assert held("swap") == held("ref") == 0


def test_restarted_ingress_replicas_still_serve_runtime_adapters(replicas, adapters):
    """Both ingress replicas die (their memory with them); Serve starts new ones, which find the adapter in
    the store. Runs last: it replaces the module's replicas."""
    import ray

    r = admin(replicas[0], "load_lora_adapter", {"lora_name": "three", "lora_path": adapters["three"]})
    assert r.status_code == 200, r.text
    before = text(chat(replicas[1], "three"))
    old = frozenset(ingress_targets())
    for name in old:  # each target's name is its replica's actor name
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    replicas[:] = two_replicas(old)
    for url in replicas:
        assert "three" in listed(url) and text(chat(url, "three")) == before
    assert admin(replicas[0], "unload_lora_adapter", {"lora_name": "three"}).status_code == 200
