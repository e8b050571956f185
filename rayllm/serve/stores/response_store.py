"""Stored responses (/v1/responses with `store`) and their input items, beside the conversations.

Composition over rayllm.serve.stores.conversation_store: the same database, connections and transactions (its
`_tx`), one more table. A response row keeps its whole context (the chain's earlier items, then this
request's input), so a `previous_response_id` chain survives the deletion of an earlier link, and each
row is bounded by rayllm.protocol.responses_api.MAX_CONTEXT_ITEMS and, in characters, by
rayllm.protocol.limits.MAX_CONTEXT_CHARS (where a long chain's rows, growing with its square, stop). Rows are
scoped by `owner` like conversations: another owner's response reads exactly like a missing one.

A response's own items (its request's input and its output; the chain's earlier items are their own
responses') are also kept one row each in `response_items`, by id: what an `item_reference` names is
found by that index, never by reading a chain.
"""

from __future__ import annotations

import json
from typing import Any

from rayllm.protocol.responses_context import check_chain, item_chars
from rayllm.serve.stores.conversation_store import ConversationStore, storable

_SCHEMA = ("""CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, created_at BIGINT NOT NULL, body TEXT NOT NULL,
    input_items TEXT NOT NULL)""",
           """CREATE TABLE IF NOT EXISTS response_items (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, response_id TEXT NOT NULL, item TEXT NOT NULL)""",
           "CREATE INDEX IF NOT EXISTS response_items_by_response ON response_items (response_id)")


class ResponseStore:
    def __init__(self, store: ConversationStore) -> None:
        self.store = store
        with store._tx() as cur:
            for stmt in _SCHEMA:
                cur.execute(stmt)

    def save(self, owner: str, body: dict[str, Any], history: list[dict[str, Any]], items: list[dict[str, Any]],
             conversation_id: str | None = None, store: bool = True) -> None:
        """In one transaction: the turn (this request's `items`, then the response's output) in its
        conversation, and, with `store`, the response with its input items (`history`, then `items`).

        KeyError: the conversation was deleted while the response was generated.
        """
        turn = items + body["output"]
        with self.store._tx() as cur:
            if conversation_id is not None:
                if self.store._get(cur, owner, conversation_id) is None:
                    raise KeyError(conversation_id)
                self.store._add_items(cur, conversation_id, turn)
            if store:
                cur.execute("INSERT INTO responses (id, owner, created_at, body, input_items) VALUES (?, ?, ?, ?, ?)",
                            (body["id"], owner, int(body["created_at"]), json.dumps(body),
                             json.dumps(history + items)))
                for item in turn:
                    cur.execute("INSERT INTO response_items (id, owner, response_id, item) VALUES (?, ?, ?, ?)",
                                (item["id"], owner, body["id"], json.dumps(item)))

    def find_items(self, owner: str, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Those of `item_ids` that name one of this owner's stored items (in a conversation, or a stored
        response's input or output): id -> item, each found by its id's index."""
        item_ids = [i for i in item_ids if storable(i)]
        with self.store._tx(write=False) as cur:
            found = self.store._owned_items(cur, owner, item_ids)
            rest = [i for i in item_ids if i not in found]
            if rest:
                marks = ", ".join("?" * len(rest))
                cur.execute(f"SELECT id, item FROM response_items WHERE owner = ? AND id IN ({marks})", (owner, *rest))
                found |= {row[0]: json.loads(row[1]) for row in cur.fetchall()}
        return found

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        row = self._row(owner, response_id)
        return None if row is None else json.loads(row[0])

    def context(self, owner: str, response_id: str, room_chars: int = 0) -> tuple[list[dict[str, Any]], int] | None:
        """What a response continuing this one starts from (its input items, then its output items) and their
        characters as stored JSON. The chain's stored length, with `room_chars` more, is checked against
        MAX_CONTEXT_CHARS in SQL before the row is read: a 400 naming previous_response_id."""
        if not storable(response_id):
            return None
        with self.store._tx(write=False) as cur:
            cur.execute("SELECT LENGTH(input_items) FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            row = cur.fetchone()
            if row is None:
                return None
            check_chain(response_id, int(row[0]) + room_chars)
            cur.execute("SELECT body, input_items FROM responses WHERE id = ?", (response_id,))
            body, inputs = cur.fetchone()
        output = json.loads(body)["output"]
        return json.loads(inputs) + output, int(row[0]) + item_chars(output)

    def input_items(self, owner: str, response_id: str, *, limit: int = 20, order: str = "desc",
                    after: str | None = None) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of the response's input items (OpenAI's cursor paging: `after` is an item id)."""
        row = self._row(owner, response_id)
        if row is None:
            return None
        items = json.loads(row[1])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [it.get("id") for it in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        return items[:limit], len(items) > limit

    def delete(self, owner: str, response_id: str) -> bool:
        if not storable(response_id):
            return False
        with self.store._tx() as cur:
            cur.execute("SELECT id FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            if cur.fetchone() is None:
                return False
            cur.execute("DELETE FROM responses WHERE id = ?", (response_id,))
            cur.execute("DELETE FROM response_items WHERE response_id = ?", (response_id,))
            return True

    def _row(self, owner: str, response_id: str) -> tuple[str, str] | None:
        if not storable(response_id):
            return None
        with self.store._tx(write=False) as cur:
            cur.execute("SELECT body, input_items FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
            return cur.fetchone()
