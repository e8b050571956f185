"""LoRA adapters loaded at runtime (POST /v1/load_lora_adapter), kept in the app's database so that every
ingress replica serves them and they outlive any one replica.

Composition over rayllm.serve.stores.conversation_store: the same database, connections and transactions
(its `_tx`), one more table. A row is keyed by (app, name): requests address an adapter by its bare name,
so names are unique across the app's models (the model is a column), and the key makes a load atomic: of
two loads of one name, exactly one insert takes it. `app` is the Serve application's name, so apps that
share a database keep apart, and a redeployed app finds its adapters again.

A row is a reservation first (`ready` 0: the name is taken, no request resolves it) while a model replica
reads and checks the files, then an adapter (`ready` 1). `token` tells a load its own row from another's.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from rayllm.serve.stores.conversation_store import ConversationStore

_SCHEMA = """CREATE TABLE IF NOT EXISTS lora_adapters (
    app TEXT NOT NULL, name TEXT NOT NULL, model TEXT NOT NULL, path TEXT NOT NULL, loaded_at BIGINT NOT NULL,
    ready INTEGER NOT NULL, token TEXT NOT NULL, PRIMARY KEY (app, name))"""


@dataclass(frozen=True)
class StoredAdapter:
    name: str
    model: str  # the base model's served name
    path: str  # canonical (adapter_paths.resolve_allowed): a local real path, or a remote source in its one spelling
    loaded_at: int  # unix seconds


class AdapterStore:
    def __init__(self, store: ConversationStore, app: str) -> None:
        self.store = store
        self.app = app
        with store._tx() as cur:
            cur.execute(_SCHEMA)

    def reserve(self, model: str, name: str, path: str) -> str | None:
        """Takes `name` for `model`: the reservation's token, or None when the app already has an adapter
        (or a load under way) of that name. One statement, so concurrent loads cannot both take it."""
        token = uuid.uuid4().hex
        with self.store._tx() as cur:
            cur.execute("INSERT INTO lora_adapters (app, name, model, path, loaded_at, ready, token) "
                        "VALUES (?, ?, ?, ?, ?, 0, ?) ON CONFLICT (app, name) DO NOTHING",
                        (self.app, name, model, path, int(time.time()), token))
            return token if cur.rowcount == 1 else None

    def confirm(self, name: str, token: str) -> bool:
        """The reservation becomes an adapter that requests resolve; False when it is gone (an unload
        of the name removed it while the model replica loaded the files)."""
        with self.store._tx() as cur:
            cur.execute("UPDATE lora_adapters SET ready = 1, loaded_at = ? WHERE app = ? AND name = ? AND token = ?",
                        (int(time.time()), self.app, name, token))
            return cur.rowcount == 1

    def release(self, name: str, token: str) -> None:
        """Gives a reservation up (the load failed); a later load's row of the same name stays."""
        with self.store._tx() as cur:
            cur.execute("DELETE FROM lora_adapters WHERE app = ? AND name = ? AND token = ? AND ready = 0",
                        (self.app, name, token))

    def remove(self, model: str, name: str) -> bool:
        """Deletes `model`'s adapter `name`, or its reservation (a load whose ingress died half-way): whether
        there was one."""
        with self.store._tx() as cur:
            cur.execute("DELETE FROM lora_adapters WHERE app = ? AND name = ? AND model = ?", (self.app, name, model))
            return cur.rowcount == 1

    def adapters(self) -> list[StoredAdapter]:
        """The app's adapters (reservations left out), by name: one read of the table's key range."""
        with self.store._tx(write=False) as cur:
            cur.execute("SELECT name, model, path, loaded_at FROM lora_adapters WHERE app = ? AND ready = 1 "
                        "ORDER BY name", (self.app,))
            return [StoredAdapter(r[0], r[1], r[2], int(r[3])) for r in cur.fetchall()]
