"""/v1/embeddings and vLLM's /v1/score and /v1/rerank, mixed into the ingress (see responses_routes.py for
why a mixin). Inputs are tokenized by the tokenizer deployment and embedded by the model deployment in one
call (LLMServer.embed), as pooling sequences batched with generation in the same engine; a score is the
cosine similarity of two texts' vectors (rayllm.protocol.scores)."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import asyncio
import sys
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import cloudpickle

from rayllm.protocol import embeddings as E
from rayllm.protocol import scores as S
from rayllm.protocol.errors import APIError
from rayllm.protocol.protocol import truncate_prompt
from rayllm.serve.auth import cache_salt
from rayllm.serve.request_guards import call_model, cancel, request_timeout
from rayllm.serve.routes.http_app import app, parse

# Serve ships the ingress class by value with its rewritten route signatures; this mixin must travel too.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EmbeddingsRoutes:
    """Mixed into rayllm.serve.ingress.Ingress, whose attributes and methods these routes use."""

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, E.EmbeddingRequest)
        await self.check_pooling_model(req.model)
        items = E.raw_inputs(req, self.config.max_sequences_per_request)
        info = await self.info()
        if req.dimensions is not None and req.dimensions > info["hidden_size"]:
            raise APIError(400, f"dimensions must be at most {info['hidden_size']} for this model, "
                           f"got {req.dimensions}", param="dimensions")
        vectors, total = await self.embed_items(owner, items, req.truncate_prompt_tokens)
        return JSONResponse(E.response_body(vectors, req, req.model or self.model_name, total))

    # vLLM's scoring routes with an embedding model (rayllm.protocol.scores): cosine similarity of the vectors
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, S.RerankRequest)
        await self.check_pooling_model(req.model)
        texts = S.document_texts(req)
        self.check_fanout(len(texts) + 1, "documents")
        vectors, total = await self.embed_items(owner, [req.query, *texts], req.truncate_prompt_tokens)
        scores = [S.cosine(vectors[0], v) for v in vectors[1:]]
        return JSONResponse(S.rerank_body(req, scores, f"rerank-{uuid.uuid4().hex}", req.model or self.model_name,
                                          total))

    @app.post("/v1/score")
    @app.post("/score")
    async def score(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, S.ScoreRequest)
        await self.check_pooling_model(req.model)
        left, right = S.score_pairs(req)
        unique = list(dict.fromkeys(left + right))  # each text embedded once
        self.check_fanout(len(unique), "text_2")
        vectors, total = await self.embed_items(owner, unique, req.truncate_prompt_tokens)
        by_text = dict(zip(unique, vectors, strict=True))
        scores = [S.cosine(by_text[a], by_text[b]) for a, b in zip(left, right, strict=True)]
        return JSONResponse(S.score_body(scores, f"score-{uuid.uuid4().hex}", req.model or self.model_name,
                                         int(time.time()), total))

    async def check_pooling_model(self, model: str | None) -> None:
        await self.select_model(model)  # an adapter loaded through another ingress replica is known too
        if model is not None and self.routes.current.adapters.name_of(model) is not None:
            raise APIError(400, f"embeddings come from the base model; a LoRA adapter ({model!r}) does not "
                           "apply to them: name the base model", param="model")

    def check_fanout(self, count: int, param: str) -> None:
        cap = self.config.max_sequences_per_request
        if cap and count > cap:
            raise APIError(400, f"this request embeds {count} texts; this server allows at most {cap} per request "
                           "(max_sequences_per_request)", param=param)

    async def embed_items(self, owner: str | None, items: list[str | list[int]],
                          truncate: int | None) -> tuple[list[list[float]], int]:
        """Texts or token-id lists -> unit-length vectors (one engine call) and the tokens they held."""
        info = await self.info()
        per_input = min(info["max_model_len"], info["capacity_tokens"])
        if self.config.max_prompt_tokens:
            per_input = min(per_input, self.config.max_prompt_tokens)
        texts = [x for x in items if not isinstance(x, list)]
        encoded = iter(await self.tokenizer.encode_batch.remote(texts) if texts else [])  # one round trip
        prompts = [truncate_prompt(list(x) if isinstance(x, list) else next(encoded), truncate, per_input)
                   for x in items]
        total = E.check_tokens(prompts, per_input, (await self.tokenizer_info())["vocab_size"])
        # The key's owner is the tenant: scheduler.max_running_share caps its pooling sequences as its generations
        embed = self.llm.embed.remote(f"embd-{uuid.uuid4().hex}", prompts, cache_salt(owner, None), owner or None)
        timeout_s = self.config.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # as generation's: the model call, from its dispatch
                return await call_model(embed, self.config.retry_after_s), total
        except TimeoutError:
            err = request_timeout(timeout_s or 0)  # raised outside the except block, as request_guards' errors
        finally:
            cancel(embed)  # a no-op once answered; else (timeout, client gone) LLMServer.embed aborts them
        raise err
