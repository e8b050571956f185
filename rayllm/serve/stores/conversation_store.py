"""The one data-access module: conversations, their items and stored completions, in SQLite or PostgreSQL.

Plain DB-API (sqlite3 from the standard library, psycopg 3 for PostgreSQL) rather than SQLAlchemy: four
tables and a dozen statements do not need an ORM, and the two backends then differ only in how a
connection is opened, the placeholder style and the auto-increment column type.

Every method is synchronous (the ingress calls them through asyncio.to_thread) and runs in one
connection: a fresh one for SQLite, one from a pool for PostgreSQL. Every write is one transaction,
committed before the method returns, so whatever the HTTP response acknowledges is on disk.

A database that is locked, full, down or slow costs a request at most `timeout_s` (SQLite's busy
timeout; PostgreSQL's connect, pool-wait and statement timeouts), then raises `StorageUnavailable`, a
503 with code `storage_unavailable`. Rows are scoped by `owner` (a digest of the caller's API key):
another owner's conversation reads exactly like a missing one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rayllm.common.errors import first_line
from rayllm.protocol.conversations import check_room
from rayllm.protocol.errors import APIError
from rayllm.protocol.responses_api import ITEM_ID_PREFIXES

log = logging.getLogger("ray.serve")

# Dialect differences: the auto-increment column (items keep their insertion order by it).
_SERIAL = {"sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT", "postgresql": "BIGSERIAL PRIMARY KEY"}

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at BIGINT NOT NULL, metadata TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS conversation_items (
        seq {serial}, id TEXT NOT NULL UNIQUE, conversation_id TEXT NOT NULL,
        created_at BIGINT NOT NULL, item TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS conversation_items_by_conv ON conversation_items (conversation_id, seq)",
    """CREATE TABLE IF NOT EXISTS completions (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, conversation_id TEXT, created_at BIGINT NOT NULL,
        metadata TEXT, body TEXT NOT NULL)""",
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def storable(item_id: str) -> bool:
    """Whether a client's id could name a row. PostgreSQL's text holds no NUL (psycopg raises DataError on one
    in a parameter), so no stored id has one: such an id is answered as unknown before it reaches the driver."""
    return "\x00" not in item_id


class StorageUnavailable(APIError):
    """The database could not be reached or written in time (503). `completion` is the generation that
    could not be stored: it goes out inside the error object, so a client loses nothing it paid for;
    `x-should-retry: false` keeps OpenAI's SDKs from generating again on their own."""

    def __init__(self, message: str = "storage is unavailable; retry later", completion: dict | None = None,
                 key: str = "completion"):
        super().__init__(503, message, type="server_error", code="storage_unavailable")
        self.completion, self.key = completion, key  # key: the error object's field (a Response: "response")
        self.headers = {"x-should-retry": "false"} if completion is not None else None

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        if self.completion is not None:
            body["error"][self.key] = self.completion
        return body


class ConversationStore:
    def __init__(self, url: str, timeout_s: float = 5.0, pool_size: int = 4) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._pool: Any = None
        if url.startswith("sqlite:///"):
            self.dialect = "sqlite"
            self.path = url[len("sqlite:///"):]
            if self.path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        elif url.startswith(("postgresql://", "postgres://")):
            self.dialect = "postgresql"
            try:  # fail at start-up, not on the first request, when the driver is missing
                from psycopg_pool import ConnectionPool
            except ImportError as exc:
                raise RuntimeError("storage_url is PostgreSQL: install the driver with "
                                   "`pip install -e '.[postgres]'` (psycopg 3 and psycopg_pool)") from exc
            # connect_timeout is whole seconds; statement_timeout is the server's bound on each statement.
            kwargs = {"connect_timeout": max(1, math.ceil(timeout_s)),
                      "options": f"-c statement_timeout={int(timeout_s * 1000)}"}
            self._pool = ConnectionPool(url, min_size=1, max_size=pool_size, kwargs=kwargs, timeout=timeout_s,
                                        check=ConnectionPool.check_connection, open=True, name="rayllm-store")
        else:
            raise ValueError(f"storage_url must start with sqlite:/// or postgresql://, got {url!r}")
        with self._tx() as cur:
            for stmt in _SCHEMA:
                cur.execute(stmt.format(serial=_SERIAL[self.dialect]))

    # ---- connections -------------------------------------------------------------------------

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    @contextmanager
    def _tx(self, write: bool = True) -> Iterator[Any]:
        """One transaction: committed when the block ends, rolled back (nothing stored) when it raises.
        A database fault (locked, full, down, timed out) becomes StorageUnavailable."""
        if self.dialect == "sqlite":
            try:
                with self._sqlite_tx(write) as cur:
                    yield cur
            except sqlite3.OperationalError as exc:  # locked past the busy timeout, disk full, I/O error
                log.warning("storage unavailable (sqlite): %s", exc)
                raise StorageUnavailable() from None
        else:
            import psycopg
            from psycopg_pool import PoolTimeout

            try:
                # commits on success, rolls back on an exception; the connection goes back to the pool
                with self._pool.connection(timeout=self.timeout_s) as conn, conn.cursor() as cur:
                    yield _Cursor(cur, "%s")
            except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
                log.warning("storage unavailable (postgresql): %s", first_line(exc))
                raise StorageUnavailable() from None

    @contextmanager
    def _sqlite_tx(self, write: bool) -> Iterator[Any]:
        # WAL: readers never block the writer, and several ingress replicas on one node share the
        # file; synchronous=FULL makes a commit durable before it returns (acknowledged = kept).
        conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            # A writer takes the lock up front (no read-to-write upgrade deadlock); readers never wait.
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            cur = conn.cursor()
            try:
                yield _Cursor(cur, "?")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        finally:
            conn.close()

    # ---- conversations -----------------------------------------------------------------------

    def create(self, owner: str, metadata: dict[str, str] | None = None,
               items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        conv = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                "metadata": metadata or {}}
        with self._tx() as cur:
            cur.execute("INSERT INTO conversations (id, owner, created_at, metadata) VALUES (?, ?, ?, ?)",
                        (conv["id"], owner, conv["created_at"], json.dumps(conv["metadata"])))
            self._add_items(cur, conv["id"], items or [])
        return conv

    def get(self, owner: str, conversation_id: str) -> dict[str, Any] | None:
        with self._tx(write=False) as cur:
            return self._get(cur, owner, conversation_id)

    def update(self, owner: str, conversation_id: str, metadata: dict[str, str]) -> dict[str, Any] | None:
        with self._tx() as cur:
            if self._get(cur, owner, conversation_id) is None:
                return None
            cur.execute("UPDATE conversations SET metadata = ? WHERE id = ?", (json.dumps(metadata), conversation_id))
            return self._get(cur, owner, conversation_id)

    def delete(self, owner: str, conversation_id: str) -> bool:
        with self._tx() as cur:
            if self._get(cur, owner, conversation_id) is None:
                return False
            cur.execute("DELETE FROM conversation_items WHERE conversation_id = ?", (conversation_id,))
            cur.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            return True

    # ---- items -------------------------------------------------------------------------------

    def add_items(self, owner: str, conversation_id: str, items: list[dict[str, Any]]) -> list[dict] | None:
        with self._tx() as cur:
            if self._get(cur, owner, conversation_id) is None:
                return None
            return self._add_items(cur, conversation_id, items)

    def items(self, owner: str, conversation_id: str, *, limit: int = 20, order: str = "desc",
              after: str | None = None) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of items (OpenAI's cursor paging: `after` is an item id) and whether more follow."""
        desc = order == "desc"
        with self._tx(write=False) as cur:
            if self._get(cur, owner, conversation_id) is None:
                return None
            sql = "SELECT item FROM conversation_items WHERE conversation_id = ?"
            params: list[Any] = [conversation_id]
            if after:
                if not storable(after):
                    return [], False
                cur.execute("SELECT seq FROM conversation_items WHERE id = ? AND conversation_id = ?",
                            (after, conversation_id))
                row = cur.fetchone()
                if row is None:
                    return [], False
                sql += " AND seq < ?" if desc else " AND seq > ?"
                params.append(row[0])
            sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
            params.append(limit + 1)
            cur.execute(sql, tuple(params))
            rows = [json.loads(r[0]) for r in cur.fetchall()]
        return rows[:limit], len(rows) > limit

    def item(self, owner: str, conversation_id: str, item_id: str) -> tuple[dict | None, dict | None]:
        """The conversation and its item `item_id`: (None, None) when there is no such conversation for this
        owner, (conversation, None) when it holds no such item."""
        with self._tx(write=False) as cur:
            conv = self._get(cur, owner, conversation_id)
            if conv is None or not storable(item_id):
                return conv, None
            cur.execute("SELECT item FROM conversation_items WHERE id = ? AND conversation_id = ?",
                        (item_id, conversation_id))
            row = cur.fetchone()
        return conv, None if row is None else json.loads(row[0])

    def delete_item(self, owner: str, conversation_id: str, item_id: str) -> tuple[dict | None, bool]:
        """Deletes one item: the conversation (None: no such conversation for this owner) and whether it held it."""
        with self._tx() as cur:
            conv = self._get(cur, owner, conversation_id)
            if conv is None or not storable(item_id):
                return conv, False
            cur.execute("SELECT seq FROM conversation_items WHERE id = ? AND conversation_id = ?",
                        (item_id, conversation_id))
            if cur.fetchone() is None:
                return conv, False
            cur.execute("DELETE FROM conversation_items WHERE id = ?", (item_id,))
            return conv, True

    def history(self, owner: str, conversation_id: str, room_for: int = 0,
                room_chars: int = 0) -> list[dict[str, Any]] | None:
        """Every item, oldest first (None: no such conversation for this owner); a 400 when the conversation
        cannot take `room_for` more items of `room_chars` characters (a turn that would not be stored is
        refused before it runs, on the stored sizes, before the items are read)."""
        with self._tx(write=False) as cur:
            if self._get(cur, owner, conversation_id) is None:
                return None
            if room_for or room_chars:
                check_room(conversation_id, *self._size(cur, conversation_id), room_for, room_chars)
            cur.execute("SELECT item FROM conversation_items WHERE conversation_id = ? ORDER BY seq",
                        (conversation_id,))
            return [json.loads(r[0]) for r in cur.fetchall()]

    # ---- stored completions --------------------------------------------------------------------

    def save_completion(self, owner: str, body: dict[str, Any], metadata: dict[str, Any] | None,
                        conversation_id: str | None = None, items: list[dict[str, Any]] | None = None) -> None:
        """The completion (with its metadata) and its turn's items, in one transaction."""
        with self._tx() as cur:
            if conversation_id is not None:
                if self._get(cur, owner, conversation_id) is None:  # deleted while generating
                    raise KeyError(conversation_id)
                self._add_items(cur, conversation_id, items or [])
            cur.execute("INSERT INTO completions (id, owner, conversation_id, created_at, metadata, body) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (body["id"], owner, conversation_id, int(body.get("created") or time.time()),
                         json.dumps(metadata) if metadata is not None else None, json.dumps(body)))

    def get_completion(self, owner: str, completion_id: str) -> dict[str, Any] | None:
        if not storable(completion_id):
            return None
        with self._tx(write=False) as cur:
            cur.execute("SELECT body, metadata FROM completions WHERE id = ? AND owner = ?", (completion_id, owner))
            row = cur.fetchone()
        if row is None:
            return None
        return json.loads(row[0]) | {"metadata": json.loads(row[1]) if row[1] else None}

    # ---- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _get(cur: _Cursor, owner: str, conversation_id: str) -> dict[str, Any] | None:
        """The conversation (None: none of this owner's): every method that takes a conversation id asks here first."""
        if not storable(conversation_id):
            return None
        cur.execute("SELECT id, created_at, metadata FROM conversations WHERE id = ? AND owner = ?",
                    (conversation_id, owner))
        row = cur.fetchone()
        if row is None:
            return None
        return {"id": row[0], "object": "conversation", "created_at": int(row[1]), "metadata": json.loads(row[2])}

    @staticmethod
    def _size(cur: _Cursor, conversation_id: str) -> tuple[int, int]:
        """Items and characters of JSON a conversation holds."""
        cur.execute("SELECT COUNT(*), COALESCE(SUM(LENGTH(item)), 0) FROM conversation_items WHERE conversation_id = ?",
                    (conversation_id,))
        count, chars = cur.fetchone()
        return int(count), int(chars)

    @staticmethod
    def _owned_items(cur: _Cursor, owner: str, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Those of `item_ids` that are items of this owner's conversations (by the items' unique id index)."""
        item_ids = [i for i in item_ids if storable(i)]
        if not item_ids:
            return {}
        cur.execute("SELECT i.id, i.item FROM conversation_items i JOIN conversations c ON c.id = i.conversation_id "
                    f"WHERE c.owner = ? AND i.id IN ({', '.join('?' * len(item_ids))})", (owner, *item_ids))
        return {row[0]: json.loads(row[1]) for row in cur.fetchall()}

    @classmethod
    def _add_items(cls, cur: _Cursor, conversation_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Stores items with the ids they carry (the server's: responses_api replaces any a client sent, so a
        Response's items keep theirs here), giving one to those without, by type."""
        now = int(time.time())
        out = [item if item.get("id") else
               dict(item) | {"id": new_id(ITEM_ID_PREFIXES.get(item.get("type", "message"), "msg"))}
               for item in items]
        rows = [json.dumps(item) for item in out]
        if rows:  # bounded at write time, so a history load is bounded too
            check_room(conversation_id, *cls._size(cur, conversation_id), len(rows), sum(map(len, rows)))
        for item, row in zip(out, rows, strict=True):
            cur.execute("INSERT INTO conversation_items (id, conversation_id, created_at, item) VALUES (?, ?, ?, ?)",
                        (item["id"], conversation_id, now, row))
        return out


class _Cursor:
    """A DB-API cursor that takes `?` placeholders whatever the driver's own style."""

    def __init__(self, cur: Any, placeholder: str) -> None:
        self.cur = cur
        self.placeholder = placeholder

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        if self.placeholder != "?":
            sql = sql.replace("?", self.placeholder)  # our SQL has no literal question marks
        self.cur.execute(sql, params)

    def fetchone(self) -> Any:
        return self.cur.fetchone()

    def fetchall(self) -> list[Any]:
        return self.cur.fetchall()

    @property
    def rowcount(self) -> int:
        return self.cur.rowcount
