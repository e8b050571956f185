"""/v1/embeddings, mixed into the ingress (see responses_routes.py for why a mixin). Inputs are tokenized
by the tokenizer deployment and embedded by the model deployment in one call (LLMServer.embed), as
pooling sequences batched with generation in the same engine."""

# No `from __future__ import annotations`: FastAPI must see real types on the route signatures.

import sys
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from ray import cloudpickle

from rayllm.protocol import embeddings as E
from rayllm.protocol.errors import APIError
from rayllm.protocol.protocol import truncate_prompt
from rayllm.serve.auth import cache_salt
from rayllm.serve.request_guards import call_model
from rayllm.serve.routes.http_app import app, parse

# Serve ships the ingress class by value with its rewritten route signatures; this mixin must travel too.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class EmbeddingsRoutes:
    """Mixed into rayllm.serve.ingress.Ingress, whose attributes and methods these routes use."""

    @app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        owner = self.check_auth(request)
        req = await parse(request, E.EmbeddingRequest)
        self.check_model(req.model)
        if req.model is not None and self.routes.current.adapters.name_of(req.model) is not None:
            raise APIError(400, f"embeddings come from the base model; a LoRA adapter ({req.model!r}) does not "
                           "apply to them: name the base model", param="model")
        items = E.raw_inputs(req, self.config.max_sequences_per_request)
        info = await self.info()
        if req.dimensions is not None and req.dimensions > info["hidden_size"]:
            raise APIError(400, f"dimensions must be at most {info['hidden_size']} for this model, "
                           f"got {req.dimensions}", param="dimensions")
        per_input = min(info["max_model_len"], info["capacity_tokens"])
        if self.config.max_prompt_tokens:
            per_input = min(per_input, self.config.max_prompt_tokens)
        texts = [x for x in items if not isinstance(x, list)]
        encoded = iter(await self.tokenizer.encode_batch.remote(texts) if texts else [])  # one round trip
        prompts = [truncate_prompt(list(x) if isinstance(x, list) else next(encoded), req.truncate_prompt_tokens,
                                   per_input) for x in items]
        total = E.check_tokens(prompts, per_input, (await self.tokenizer_info())["vocab_size"])
        # The key's owner is the tenant: scheduler.max_running_share caps its pooling sequences as its generations
        embed = self.llm.embed.remote(f"embd-{uuid.uuid4().hex}", prompts, cache_salt(owner, None), owner or None)
        vectors = await call_model(embed, self.config.retry_after_s)
        return JSONResponse(E.response_body(vectors, req, req.model or self.model_name, total))
