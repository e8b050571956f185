"""Runtime-loaded LoRA adapters in the app's database, on SQLite (a file) and on a real PostgreSQL server:
the atomic reservation, its confirmation or release, and the rows each ingress replica reads."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from rayllm.serve.stores.adapter_store import AdapterStore, StoredAdapter
from rayllm.serve.stores.conversation_store import ConversationStore, StorageUnavailable
from tests.serve.stores.store_urls import fresh_url


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    return fresh_url(request, tmp_path, "lora_adapters")


def store(url: str, app: str = "app") -> AdapterStore:
    """What an ingress replica opens at start (a fresh one per call: another replica, or a restart)."""
    return AdapterStore(ConversationStore(url), app)


def names(s: AdapterStore) -> list[tuple[str, str, str]]:
    return [(a.name, a.model, a.path) for a in s.adapters()]


def test_a_load_reserves_then_confirms_and_an_unload_removes(url):
    a, b = store(url), store(url)  # two ingress replicas of one app
    token = a.reserve("base", "poet", "/adapters/poet")
    assert token and b.adapters() == []  # reserved while a model replica loads it: no request resolves it yet
    assert b.reserve("base", "poet", "/adapters/other") is None  # the name is taken, whoever asks
    assert a.confirm("poet", token)
    (row,) = b.adapters()
    assert isinstance(row, StoredAdapter) and (row.name, row.model, row.path) == ("poet", "base", "/adapters/poet")
    assert row.loaded_at > 1_700_000_000
    assert store(url).adapters() == [row]  # a restarted replica finds it
    assert not b.remove("tiny", "poet")  # another model's adapter of that name: none here
    assert b.remove("base", "poet") and a.adapters() == [] and not a.remove("base", "poet")
    assert a.reserve("base", "poet", "/adapters/other")  # free again


def test_a_refused_load_gives_its_reservation_up_and_an_unload_beats_a_load_under_way(url):
    s = store(url)
    first = s.reserve("base", "poet", "/adapters/poet")
    s.release("poet", first)
    second = s.reserve("base", "poet", "/adapters/poet2")
    s.release("poet", first)  # a stale release never takes a later load's reservation
    assert s.confirm("poet", second) and names(s) == [("poet", "base", "/adapters/poet2")]
    s.release("poet", second)  # nor a confirmed adapter
    assert names(s) == [("poet", "base", "/adapters/poet2")]
    # An unload while a model replica loads: the reservation goes, and the load cannot confirm.
    token = s.reserve("base", "sql", "/adapters/sql")
    assert s.remove("base", "sql") and not s.confirm("sql", token) and names(s) == [("poet", "base", "/adapters/poet2")]


def test_apps_sharing_a_database_keep_apart(url):
    one, two = store(url, "one"), store(url, "two")
    assert one.confirm("poet", one.reserve("base", "poet", "/a/1"))
    assert two.confirm("poet", two.reserve("base", "poet", "/a/2"))  # the same name in another app
    assert names(one) == [("poet", "base", "/a/1")] and names(two) == [("poet", "base", "/a/2")]
    assert two.remove("base", "poet") and names(one) == [("poet", "base", "/a/1")]


def test_concurrent_loads_of_one_name_exactly_one_wins(url):
    """Ingress replicas reserve at the same moment (each its own connection): one insert takes the name."""
    replicas = [store(url) for _ in range(8)]
    start = threading.Barrier(len(replicas))
    tokens: list[str | None] = [None] * len(replicas)

    def load(i: int) -> None:
        start.wait()
        tokens[i] = replicas[i].reserve("base", "poet", f"/adapters/{i}")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [i for i, t in enumerate(tokens) if t is not None]
    assert len(won) == 1
    assert replicas[0].confirm("poet", tokens[won[0]]) and names(replicas[0]) == [("poet", "base", f"/adapters/{won[0]}")]


def test_a_locked_sqlite_database_is_storage_unavailable(tmp_path):
    s = AdapterStore(ConversationStore(f"sqlite:///{tmp_path}/conv.db", timeout_s=0.3), "app")
    lock = sqlite3.connect(tmp_path / "conv.db", isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another process holds the write lock past the busy timeout
    try:
        with pytest.raises(StorageUnavailable) as err:
            s.reserve("base", "poet", "/a")
        assert err.value.status_code == 503 and err.value.code == "storage_unavailable"
    finally:
        lock.execute("ROLLBACK")
    assert s.reserve("base", "poet", "/a")
