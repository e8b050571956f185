"""/v1/conversations and stored chat completions, mixed into the ingress (as rayllm.serve.routes.responses_routes:
Serve binds FastAPI routes declared on any class of the ingress's MRO). Storage: rayllm.serve.stores.conversation_store."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import asyncio
import json
import sys

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import cloudpickle

from rayllm.protocol import conversations as C
from rayllm.protocol import protocol as P
from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import APIError, not_found
from rayllm.protocol.limits import OUTPUT_ITEM_CHARS, turn_output_chars
from rayllm.serve.request_guards import conversation_not_found
from rayllm.serve.routes.http_app import app, parse, parse_query, read_body

# Shipped by value with the ingress class, as responses_routes (the replica needs Serve's rewritten signatures).
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def item_not_found(item_id: str) -> APIError:
    return not_found(f"Item with id '{item_id}' not found.", param="item_id", code="item_not_found")


def client_items(items: list[dict] | None) -> list[dict]:
    """Items a client adds: any input item the Responses API takes, checked by its rules, with our own ids."""
    return [R.canonical_item(it, f"items.{i}") for i, it in enumerate(items or [])]


def chat_turn_room(req: P.ChatCompletionRequest, last_input: dict) -> tuple[int, int]:
    """The items and characters a chat turn stored into its conversation needs (rayllm.protocol.conversations.
    turn_items: the last input message, a thought and the answer), reserved before it runs; none unless stored."""
    if not req.store:
        return 0, 0
    max_tokens = req.max_completion_tokens or req.max_tokens
    return 3, len(json.dumps(last_input)) + OUTPUT_ITEM_CHARS + turn_output_chars(2, max_tokens)


class ConversationRoutes:
    """Mixed into rayllm.serve.ingress.Ingress, whose `store` and `check_auth` these routes use."""

    async def conversation_history(self, owner: str, cid: str, room_for: int, room_chars: int = 0) -> list[dict]:
        """Its items; a 400 when it has no room for `room_for` more items of `room_chars` characters (this
        turn's, stored after it: checked before the model runs)."""
        items = await asyncio.to_thread(self.store.history, owner, cid, room_for, room_chars)
        if items is None:  # missing, or another key's: the same answer, so nothing leaks
            raise conversation_not_found(cid)
        return items

    @app.post("/v1/conversations")
    async def create_conversation(self, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        body = await read_body(request)
        req = await parse(request, C.ConversationCreate) if body.strip() else C.ConversationCreate()
        return JSONResponse(await asyncio.to_thread(self.store.create, owner, req.metadata, client_items(req.items)))

    @app.get("/v1/conversations/{cid}")
    async def get_conversation(self, cid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        conv = await asyncio.to_thread(self.store.get, owner, cid)
        if conv is None:
            raise conversation_not_found(cid)
        return JSONResponse(conv)

    @app.post("/v1/conversations/{cid}")
    async def update_conversation(self, cid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        req = await parse(request, C.ConversationUpdate)
        conv = await asyncio.to_thread(self.store.update, owner, cid, req.metadata)
        if conv is None:
            raise conversation_not_found(cid)
        return JSONResponse(conv)

    @app.delete("/v1/conversations/{cid}")
    async def delete_conversation(self, cid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        if not await asyncio.to_thread(self.store.delete, owner, cid):
            raise conversation_not_found(cid)
        return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})

    @app.get("/v1/conversations/{cid}/items")
    async def list_items(self, cid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        q = parse_query(request, C.ItemsQuery)
        page = await asyncio.to_thread(self.store.items, owner, cid, limit=q.limit, order=q.order, after=q.after)
        if page is None:
            raise conversation_not_found(cid)
        return JSONResponse(C.items_page(*page))

    @app.post("/v1/conversations/{cid}/items")
    async def add_items(self, cid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        req = await parse(request, C.ItemsCreate)
        added = await asyncio.to_thread(self.store.add_items, owner, cid, client_items(req.items))
        if added is None:
            raise conversation_not_found(cid)
        return JSONResponse(C.items_page(added, False))

    @app.get("/v1/conversations/{cid}/items/{item_id}")
    async def get_item(self, cid: str, item_id: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        conv, item = await asyncio.to_thread(self.store.item, owner, cid, item_id)
        if conv is None:
            raise conversation_not_found(cid)
        if item is None:
            raise item_not_found(item_id)
        return JSONResponse(item)

    @app.delete("/v1/conversations/{cid}/items/{item_id}")
    async def delete_item(self, cid: str, item_id: str, request: Request) -> JSONResponse:
        """Answers the conversation, as OpenAI does."""
        owner = self.check_auth(request)
        conv, deleted = await asyncio.to_thread(self.store.delete_item, owner, cid, item_id)
        if conv is None:
            raise conversation_not_found(cid)
        if not deleted:
            raise item_not_found(item_id)
        return JSONResponse(conv)

    @app.get("/v1/chat/completions/{completion_id}")
    async def get_stored_completion(self, completion_id: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        body = await asyncio.to_thread(self.store.get_completion, owner, completion_id)
        if body is None:
            raise not_found(f"No stored completion found with id '{completion_id}'.", param="completion_id",
                            code="completion_not_found")
        return JSONResponse(body)
