"""A real Ray Serve deployment of the whole app on the default model, shared by the serve tests."""

from __future__ import annotations

import hashlib
import json
import os
import threading

import pytest

# This process reads Serve's constants first, with Serve's defaults: tests call deployment handles from
# synchronous code, which needs the router's own thread. Every Ray process started after this inherits
# the shipped environment (serving.env: Serve's throughput mode, HAProxy, worker niceness).
from rayllm.serve.serving_env import serving_env  # noqa: E402  (torch-free, reads no Serve constant)

# A pytest-xdist worker inherits the environment its controller set here: take the serving lines back out
# first, or this process would read them as its own.
for _k, _v in serving_env().items():
    if os.environ.get(_k) == _v:
        del os.environ[_k]
import ray.serve._private.constants  # noqa: E402, F401

from tests.serve.ops_apps import (  # noqa: E402
    SESSION,
    SHARED_APPS,
    SMALL_ENGINE,
    Receiver,
    deploy,
    free_port,
    own_haproxy_env,
    tiny_checkpoints,
    wait_healthy,
)

os.environ.update(serving_env())


# This session's HAProxy ports apart from any other Serve instance's on the machine.
os.environ.update(own_haproxy_env())

API_KEY = "test-key-123"
# A second tenant, configured by its digest only (`sha256:<hex>`): isolation and hashed-key tests.
API_KEY_2 = "test-key-456"
# May load and unload LoRA adapters (admin_api_keys); also an ordinary API key.
ADMIN_KEY = "test-admin-789"
# The session app's grammar compile bound (10 s shipped): test_abuse waits one slow compile out; others take < 1 s.
GRAMMAR_COMPILE_TIMEOUT_S = 5


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    import ray
    from ray import serve

    from rayllm.serve.builder import build_app

    port = free_port()
    # Conversations go to a throwaway SQLite file (every app these tests build, through STORAGE_URL).
    os.environ["STORAGE_URL"] = f"sqlite:///{tmp_path_factory.mktemp('state')}/conversations.db"
    # More logical CPUs than cores: the ingress and tokenizer reserve none, TP ranks one each.
    ray.init(address="local", num_cpus=5, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # bf16 with the shipped 4-bit x int8 kernels, plus `batch_invariant` so that a greedy answer does not
    # depend on what shares its steps (several tests compare answers alone and in a batch): that mode runs
    # those kernels at every step size (prefill chunks and the LM head too) where the shipped mode switches to
    # oneDNN's bf16 GEMMs past 256 tokens and the LM head past 4 rows. Tests against transformers' fp32 logits
    # use `fp32_client`.
    app = build_app({
        "api_keys": [API_KEY, "sha256:" + hashlib.sha256(API_KEY_2.encode()).hexdigest()],
        "admin_api_keys": [ADMIN_KEY],
        "stream_interval_s": 0.05,  # the coalescing path that cluster.yaml enables
        # Off by default (test_operations checks that); on here, where chat templates and reasoning are tested.
        "allow_request_chat_template": True,
        # test_tenants waits this out three times (a locked database); writes here take milliseconds.
        "storage_timeout_s": 2,
        "grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S,
        "engine": {"model": {"dtype": "bfloat16", "max_model_len": 2048},
                   "cache": {"kv_cache_bytes": 512 << 20},
                   "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 512, "batch_invariant": True}},
    })
    serve.run(app, name="llm", route_prefix="/", blocking=False)
    SESSION["url"] = wait_healthy(f"http://127.0.0.1:{port}")
    yield SESSION["url"]
    del SESSION["url"]
    # Not serve.shutdown(): its graceful stop of every replica took 16-21 s at the end of each run, and the
    # graceful paths are tested on their own (test_scaling_and_drain, test_stop_leaves_nothing). Stopping
    # this Ray instance ends its replicas, their engine processes and HAProxy (each dies with its parent).
    ray.shutdown()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def fp32_server(shared_apps, request) -> str:
    """The default model served in fp32 (ops_apps.SMALL_ENGINE), for the tests that hold the served
    numbers to transformers' fp32 model on the same GGUF at fp32 tolerances; deleted after its last user."""
    return shared_apps.get(request, "fp32", {"api_keys": [API_KEY], "engine": SMALL_ENGINE})


@pytest.fixture(scope="module")
def fp32_client(fp32_server):
    from openai import OpenAI

    return OpenAI(base_url=f"{fp32_server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def client2(server):
    """The second tenant, whose key the server knows only by its sha256 digest."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server}/v1", api_key=API_KEY_2, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(server):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def llm_stats(server):
    """The model replica's engine counters (running/waiting sequences, KV usage)."""
    from ray import serve

    handle = serve.get_deployment_handle("llm", app_name="llm")
    return lambda: handle.stats.remote().result()


@pytest.fixture(scope="session")
def model_name() -> str:
    return "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def apps():
    """Names of the extra apps this module deployed; all deleted at the end, without waiting for their
    replicas to stop (seconds each; later tests only look at their own apps)."""
    from ray import serve

    names: list[str] = []
    yield names
    for name in names:
        try:
            serve.delete(name, _blocking=False)
        except Exception:
            pass


class SharedApps:
    """Extra apps shared across modules: each deployed once, by the first module fixture that asks for it,
    and reused by every later one (the same name must come with the same args, or it fails loudly). An app
    is deleted after the last collected test that uses one of its fixtures (ops_apps.SHARED_APPS names
    them; pytest_runtest_teardown below), so it holds no CPUs beyond its users."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.urls: dict[str, str] = {}
        self.configs: dict[str, str] = {}
        self.users: dict[str, frozenset[str]] = {}  # deployed app -> the fixtures that use it
        self._last_use: dict[str, int] | None = None
        self._position: dict[int, int] = {}

    def get(self, request: pytest.FixtureRequest, name: str, args: dict) -> str:
        assert request.fixturename in SHARED_APPS[name], f"add {request.fixturename} to SHARED_APPS[{name!r}]"
        config = json.dumps(args, sort_keys=True, default=str)
        assert self.configs.setdefault(name, config) == config, f"app {name} asked for with other args: {config}"
        self.users[name] = SHARED_APPS[name]  # deleted after its users, even if the deploy fails
        if name not in self.urls:
            self.urls[name] = deploy(self.server, name, args)
        return self.urls[name]

    def release_after(self, item: pytest.Item) -> None:
        """Delete the apps that no later test uses (without waiting for their replicas to stop)."""
        from ray import serve

        if self._last_use is None:  # fixture name -> position of the last collected test using it
            self._last_use = {name: i for i, it in enumerate(item.session.items) for name in it.fixturenames}
            self._position = {id(it): i for i, it in enumerate(item.session.items)}
        here = self._position.get(id(item), -1)
        for name, users in list(self.users.items()):
            if all(self._last_use.get(user, -1) <= here for user in users):
                self.urls.pop(name, None)
                del self.users[name]
                try:
                    serve.delete(name, _blocking=False)
                except Exception:
                    pass


_SHARED = pytest.StashKey[SharedApps]()


@pytest.fixture(scope="session")
def shared_apps(server, request) -> SharedApps:
    apps = SharedApps(server)
    request.config.stash[_SHARED] = apps
    return apps


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    apps = item.config.stash.get(_SHARED, None)
    # After the last test the session's Ray instance stops with every app; a delete then (past that stop)
    # waited ~5 s for a Ray that was gone.
    if apps is not None and apps.users and nextitem is not None:
        apps.release_after(item)


@pytest.fixture(scope="session")
def otlp_receiver() -> Receiver:
    """An OTLP/HTTP receiver in this process, for apps that export traces (see ops_apps.prio_args)."""
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    yield receiver
    receiver.shutdown()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, hf_tokenizer) -> dict[str, str]:
    """The tiny random models of ops_apps.tiny_checkpoints, by name (the several-model app's, and the tiny Llama
    that the LoRA-replica, TP=2, fault, preemption and prefix-router apps serve)."""
    return tiny_checkpoints(tmp_path_factory.mktemp("tiny_models"), hf_tokenizer)
