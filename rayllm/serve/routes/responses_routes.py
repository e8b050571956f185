"""/v1/responses routes, mixed into the ingress (Serve binds FastAPI routes declared on any class of the
ingress's MRO). A Responses request becomes a chat request and runs through the ingress's own render /
run machinery; rayllm.protocol.responses_events turns its deltas into the Response and its semantic events."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import asyncio
import logging
import sys
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import cloudpickle

from rayllm.protocol import conversations as C
from rayllm.protocol import protocol as P
from rayllm.protocol import responses_api as R
from rayllm.protocol import responses_context as RC
from rayllm.protocol.choice_state import ChoiceState, GenerationState
from rayllm.protocol.errors import APIError, bad_request, not_found
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.responses_events import ResponseAssembler, skeleton, sse
from rayllm.protocol.sse import Pieces, WireFormat
from rayllm.serve.request_guards import conversation_not_found
from rayllm.serve.routes.http_app import app, parse, parse_query
from rayllm.serve.stores.conversation_store import StorageUnavailable
from rayllm.serve.stores.response_store import ResponseStore

log = logging.getLogger("ray.serve")
# Serve ships the ingress class to its replica by value, with the route signatures it rewrote (`self`
# injected); routes on this mixin must travel the same way, or the replica's copies lack the rewrite.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def response_not_found(rid: str, param: str = "response_id") -> APIError:
    return not_found(f"Response with id '{rid}' not found.", param=param, code="response_not_found")


class ResponsesFormat(WireFormat):
    """A Response and its semantic events (rayllm.protocol.responses_events), written as the stream loop feeds it."""

    def __init__(self, state: GenerationState, frame: dict[str, Any], rid: str, max_items: int | None = None) -> None:
        super().__init__(state)
        self.asm = ResponseAssembler(frame)
        self.rid = rid
        self.max_items = max_items  # a conversation turn's: the room reserved for its output (turn_output_items)

    def _fed(self, d: GenerationDelta, pieces: Pieces) -> list[dict[str, Any]]:
        events = self.asm.feed(d, pieces)
        if self.max_items is not None and len(self.asm.output) > self.max_items:
            # Past the reserved room the turn could not be stored: fail now rather than after generating it all.
            raise APIError(400, f"the response made more than {self.max_items} output items, more than a "
                           "conversation turn keeps; set parallel_tool_calls to false or leave out conversation",
                           param="parallel_tool_calls", code="too_many_output_items")
        return events

    def head(self) -> str:
        return "".join(sse(ev) for ev in self.asm.start())

    def feed(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> None:
        self._fed(d, pieces)

    def delta(self, c: ChoiceState, d: GenerationDelta, pieces: Pieces) -> str:
        return "".join(sse(ev) for ev in self._fed(d, pieces))

    def finish(self) -> str:
        return "".join(sse(ev) for ev in self.asm.finish())

    def tail(self) -> str:
        return sse(self.asm.done_event())

    def error(self, exc: BaseException) -> str:
        if not isinstance(exc, APIError):
            log.error("response stream failed (%s)", self.rid, exc_info=exc)
        return "".join(sse(ev) for ev in self.asm.error_events(R.renamed(exc) if isinstance(exc, APIError) else exc))

    def body(self) -> dict[str, Any]:
        return self.asm.final()


class ResponsesRoutes:
    """Mixed into rayllm.serve.ingress.Ingress, whose attributes and methods these routes use."""

    def response_store(self) -> ResponseStore:
        if getattr(self, "_response_store", None) is None:
            self._response_store = ResponseStore(self.store)
        return self._response_store

    @app.post("/v1/responses")
    async def create_response(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, R.ResponseCreate)
        R.check_supported(req)
        items = R.input_items(req)
        cid = C.conversation_id(req.conversation)
        history: list[dict] = []
        chain_chars, sent = 0, RC.item_chars(items)
        if req.previous_response_id is not None:  # the chain's stored length is checked before it is read
            found = await asyncio.to_thread(self.response_store().context, owner, req.previous_response_id, sent)
            if found is None:  # missing, or another key's: the same answer
                raise response_not_found(req.previous_response_id, "previous_response_id")
            history, chain_chars = found
        elif cid is not None:  # room for the input and the most output a response may make, before it runs
            history = await self.conversation_history(owner, cid, *RC.turn_room(req, items))
        RC.check_unique(req.input, history)
        if R.reference_ids(items):  # the copies they became count against the same bounds
            items = await self.resolved(owner, items)
            sent = RC.item_chars(items)
            if cid is not None:
                C.check_room(cid, len(history), RC.item_chars(history), *RC.turn_room(req, items))
        if req.previous_response_id is not None:
            RC.check_chain(req.previous_response_id, chain_chars + sent)
        RC.check_tool_outputs(history, items)
        if len(history) + len(items) > R.MAX_CONTEXT_ITEMS:
            raise bad_request(f"the context would hold {len(history) + len(items)} items; at most "
                              f"{R.MAX_CONTEXT_ITEMS} are allowed", param="input")
        messages = R.items_to_messages(history + items)
        if req.instructions:
            messages.insert(0, {"role": "system", "content": req.instructions})
        if not messages:
            raise bad_request("input has no message to answer", param="input")
        try:
            return await self.generate_response(request, owner, req, R.chat_request(req, messages), history,
                                                items, cid)
        except APIError as exc:
            raise R.renamed(exc) from None

    async def resolved(self, owner: str, items: list[dict]) -> list[dict]:
        """The input with its item references resolved by id among the owner's stored items (an item of the
        context this request loaded is never one: check_unique refused it as a duplicate)."""
        known = await asyncio.to_thread(self.response_store().find_items, owner, sorted(R.reference_ids(items)))
        return R.resolve_references(items, known)

    async def generate_response(self, request: Request, owner: str, req: R.ResponseCreate,
                                chat: P.ChatCompletionRequest, history: list[dict], items: list[dict],
                                cid: str | None):
        """A response runs the chat handler's steps (Ingress.prepare_chat) on the chat request it became."""
        rid = R.new_item_id("resp")
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        try:
            greq, factory = await self.prepare_chat(request, owner, chat, messages, rid, param="input")
        except APIError as exc:
            if req.truncation != "auto" or exc.code not in R.TOO_LONG:
                raise
            greq, factory = await self.truncated(request, owner, chat, messages, rid, exc)
        fmt = ResponsesFormat(GenerationState(greq.n, factory), skeleton(req, rid, req.model or self.model_name, cid),
                              rid, R.turn_output_items(req) if cid is not None else None)

        async def keep(_: GenerationState) -> None:
            """Stores the response (and the turn in its conversation) before the client sees it end."""
            body = fmt.asm.final()
            if body["status"] == "failed" or (req.store is False and cid is None):  # an aborted generation
                return
            try:
                await asyncio.to_thread(self.response_store().save, owner, body, history, items, cid,
                                        req.store is not False)
            except KeyError:
                raise conversation_not_found(cid or "") from None
            except StorageUnavailable:  # the 503 carries the response (a stream has sent its deltas already)
                where = "the response.failed event's response" if req.stream else "error.response"
                raise StorageUnavailable("the response was generated but could not be stored (storage is "
                                         f"unavailable); it is in {where}", completion=body,
                                         key="response") from None

        return await self.run(greq, fmt, chat, on_complete=keep)

    async def truncated(self, request: Request, owner: str, chat: P.ChatCompletionRequest, messages: list[dict],
                        rid: str, too_long: APIError):
        """OpenAI's truncation "auto": the request with the fewest oldest turns dropped that fits (a binary
        search over where the kept turns start, one render per probe); the last turn alone not fitting is
        the original error."""
        head, starts = R.turn_starts(messages)
        # Candidates: keep from starts[k] on. starts[0] == head is the whole conversation, which did not fit.
        lo, hi, found = (1 if starts and starts[0] == head else 0), len(starts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            try:
                found = await self.prepare_chat(request, owner, chat, messages[:head] + messages[starts[mid]:], rid,
                                                param="input")
                hi = mid - 1
            except APIError as exc:
                if exc.code not in R.TOO_LONG:
                    raise
                lo = mid + 1
        if found is None:  # successes only move left: the last one is the most kept that fits
            raise too_long
        return found

    @app.get("/v1/responses/{rid}")
    async def get_response(self, rid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        body = await asyncio.to_thread(self.response_store().get, owner, rid)
        if body is None:
            raise response_not_found(rid)
        return JSONResponse(body)

    @app.delete("/v1/responses/{rid}")
    async def delete_response(self, rid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        if not await asyncio.to_thread(self.response_store().delete, owner, rid):
            raise response_not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.get("/v1/responses/{rid}/input_items")
    async def list_input_items(self, rid: str, request: Request) -> JSONResponse:
        owner = self.check_auth(request)
        q = parse_query(request, C.ItemsQuery)
        page = await asyncio.to_thread(self.response_store().input_items, owner, rid, limit=q.limit, order=q.order,
                                       after=q.after)
        if page is None:
            raise response_not_found(rid)
        return JSONResponse(C.items_page(*page))
