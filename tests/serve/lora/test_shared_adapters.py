"""Each ingress replica's view of the runtime-loaded adapters (rayllm/serve/lora/shared_adapters.py) on a
real SQLite store: what another replica loaded resolves at once, what it unloaded is gone within fresh_s,
base-model requests never read the store. The load and unload routes through Ray Serve are in
tests/serve/test_lora_replicas.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayllm.protocol.errors import APIError
from rayllm.serve.config import ServerConfig
from rayllm.serve.lora.shared_adapters import FRESH_S, SharedAdapters
from rayllm.serve.routes.model_routes import ModelRoutes
from rayllm.serve.stores.adapter_store import AdapterStore
from rayllm.serve.stores.conversation_store import ConversationStore, StorageUnavailable

FRESH = 0.3  # a short bound for the test; the server's is FRESH_S


def routes() -> ModelRoutes:
    config = ServerConfig.from_args({"models": [
        {"served_model_name": "base", "engine": {"lora": {"max_loras": 2, "adapters": {"sql": "/a/sql"}}}},
        {"served_model_name": "plain", "engine": {}},  # no LoRA slots
    ]})
    return ModelRoutes(config.models, {"base": None, "plain": None}, None, created=0)


def replica(url: str) -> SharedAdapters:
    """One ingress replica: its model table and its view of the app's store."""
    return SharedAdapters(AdapterStore(ConversationStore(url), "app"), routes(), fresh_s=FRESH)


def load(shared: SharedAdapters, model: str, name: str, path: str) -> None:
    """A load route's store steps (the model replica's part is the Serve test's)."""
    assert shared.store.confirm(name, shared.store.reserve(model, name, path))


def served(shared: SharedAdapters, model: str) -> tuple[str | None, str | None]:
    """What a request for `model` resolves to through this replica (404 model_not_found if nothing)."""
    asyncio.run(shared.lookup(model))
    route = shared.routes.find(model)
    return route.adapters.resolve(model, None)


def test_another_replicas_load_resolves_at_once_and_its_unload_within_the_bound(tmp_path):
    url = f"sqlite:///{tmp_path}/conv.db"
    a, b = replica(url), replica(url)
    assert FRESH_S <= 5  # docs/lora.md states the bound
    asyncio.run(b.read())  # b has just read the store: its view is fresh, without "poet"
    load(a, "base", "poet", "/a/poet")
    # A name b does not know is looked up at once, fresh view or not (by either addressing).
    assert served(b, "poet") == ("poet", "/a/poet") and served(b, "base:poet") == ("poet", "/a/poet")
    assert a.store.remove("base", "poet")
    unloaded = time.monotonic()
    try:
        while served(b, "poet") == ("poet", "/a/poet"):  # a known name: served from b's view while it is fresh
            time.sleep(0.02)
    except APIError as err:
        assert err.status_code == 404 and err.code == "model_not_found"
    assert time.monotonic() - unloaded < FRESH + 0.2
    with pytest.raises(APIError):
        served(b, "poet")


def test_config_wins_and_models_without_lora_take_no_adapter(tmp_path):
    url = f"sqlite:///{tmp_path}/conv.db"
    a = replica(url)
    load(a, "base", "sql", "/elsewhere")  # a row a newer cluster.yaml took the name of
    load(a, "plain", "odd", "/a/odd")  # a model that has no LoRA slots (its configuration changed)
    load(a, "gone", "old", "/a/old")  # a model this app no longer serves
    asyncio.run(a.read())
    assert served(a, "sql") == ("sql", "/a/sql")
    for name in ("odd", "old"):
        with pytest.raises(APIError) as err:
            served(a, name)
        assert err.value.code == "model_not_found"


def test_base_model_requests_never_read_the_store(tmp_path):
    """A database that is down costs adapter requests a 503 storage_unavailable, and nothing else."""
    url = f"sqlite:///{tmp_path}/conv.db"
    a = replica(url)
    (tmp_path / "conv.db").unlink()
    (tmp_path / "conv.db").mkdir()  # no database file can be opened there now
    for model in (None, "base", "plain"):
        asyncio.run(a.lookup(model))
        assert a.routes.find(model).adapters.resolve(model, None) == (None, None)
    assert served(a, "sql") == ("sql", "/a/sql")  # cluster.yaml's: no store needed
    with pytest.raises(StorageUnavailable) as err:
        served(a, "poet")
    assert err.value.status_code == 503 and err.value.code == "storage_unavailable"


class CountingStore(AdapterStore):
    """The real SQLite store, counting its reads of the adapter table."""

    reads = 0

    def adapters(self):
        self.reads += 1
        return super().adapters()


def test_unknown_names_cost_one_read_per_fresh_s_and_concurrent_ones_share_it(tmp_path):
    url = f"sqlite:///{tmp_path}/conv.db"
    store = CountingStore(ConversationStore(url), "app")
    b = SharedAdapters(store, routes(), fresh_s=FRESH)

    async def requests() -> None:
        await asyncio.gather(*(b.lookup(f"nope-{i}") for i in range(50)))  # at once: one shared read
        for i in range(50):  # again, one by one, within the bound: no read
            await b.lookup(f"nope-{i}")
            await b.lookup(None, f"nope-{i}")

    asyncio.run(requests())
    assert store.reads == 1
    # Loaded through another replica after b missed the name: b serves it within the bound.
    load(replica(url), "base", "nope-1", "/a/nope")
    with pytest.raises(APIError):
        served(b, "nope-1")
    time.sleep(FRESH)
    assert served(b, "nope-1") == ("nope-1", "/a/nope") and store.reads == 2
    # A name b never missed is read for at once, fresh view or not.
    load(replica(url), "base", "new", "/a/new")
    assert served(b, "new") == ("new", "/a/new") and store.reads == 3
