"""Tokenizer and chat template: rendering and tokenizing (detokenizing lives in rayllm.serve.detokenizer).

`TokenizerService` is plain Python (testable without Ray); `TokenizerDeployment` serves one per model
of the app with its own CPU replicas. Detokenizing (`rayllm.serve.detokenizer`) runs beside the engine in the model deployment.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import ray
from ray import serve

from rayllm.loader.model_files import resolve_model_path
from rayllm.protocol.request_models import json_size
from rayllm.protocol.tools import detect_tool_format
from rayllm.serve.chat_template import (
    END_OF_TURN_TOKENS,
    FIM_TOKEN_SETS,
    ChatRenderer,
    load_serving_tokenizer,
    load_tokenizer,
)
from rayllm.serve.detokenizer import fast_backend
from rayllm.serve.render_channel import LARGE_INPUT, RenderServer
from rayllm.serve.rust_tokenizer import RustTokenizer, warm_chat_templates
from rayllm.serve.serving_priority import ServingPriority
from rayllm.serve.template_sandbox import TemplateSandbox
from rayllm.serve.tracing import TracingConfig, configure, remote_span

log = logging.getLogger("ray.serve")
T = TypeVar("T")
LARGE_IDS = LARGE_INPUT // 4  # token ids to decode (a token is about four characters)


# Roles some chat templates do not know, mapped onto ones they do.
@functools.lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _generation_config_eos(model_path: str) -> list[int]:
    """EOS ids a Hugging Face directory's generation_config.json adds (a GGUF has them in its metadata)."""
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [eos] if isinstance(eos, int) else [int(e) for e in eos or ()]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerService:
    """Chat rendering, encoding and decoding for one model; plain methods so Ray is optional."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        # From its snapshot when there is one (rayllm.serve.rust_tokenizer: no transformers, no torch import).
        self.tokenizer = load_serving_tokenizer(model_path)
        self.renderer = ChatRenderer(self.tokenizer)
        tok = self.tokenizer
        vocab = tok.get_vocab()
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        # Chat models end a turn with their own token, which is not always the configured EOS.
        eos.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        eos.update(_generation_config_eos(model_path))
        self.eos_token_ids: list[int] = sorted(eos)
        self.bos_token_id: int | None = tok.bos_token_id
        self.vocab_size: int = len(tok)  # base vocab plus added tokens: the valid id range
        self.fim_tokens: tuple[str, str, str] | None = next(
            (ts for ts in FIM_TOKEN_SETS if all(t in vocab for t in ts)), None
        )
        self.has_fim_tokens: bool = self.fim_tokens is not None
        backend = fast_backend(tok)
        self._backend = backend
        self._added = set(tok.added_tokens_decoder)
        # Byte-level BPE (GPT-2 style) pieces map characters to bytes; SentencePiece pieces do not.
        self._byte_level = backend is not None and '"ByteLevel"' in json.dumps(json.loads(backend.to_str())["decoder"])
        # The snapshot's encode is the backend's own: large texts can take the backend's GIL-free path with specials too.
        self._snapshot = isinstance(tok, RustTokenizer)
        # Ids alone (tokenizers >= 0.21): no offsets or token strings, whose freeing holds the GIL (0.1 s a megabyte).
        self._encode_ids = None if backend is None else getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    def transformers_tokenizer(self) -> Any:
        """transformers' own tokenizer of this model (xgrammar's TokenizerInfo takes only that): loaded on the
        first call when the service runs on the snapshot."""
        if isinstance(self.tokenizer, RustTokenizer):
            with self._hf_lock:
                if self._hf is None:
                    self._hf = load_tokenizer(self.model_path)
            return self._hf
        return self.tokenizer

    def info(self) -> dict:
        templates = self.renderer.templates()
        try:  # the calls a model writes are those of the template that offers it tools (tool_use, of named ones)
            tool_template = self.renderer.template(tools=[])
        except ValueError:  # named templates without a default nor tool_use
            tool_template = None
        return {"vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids,
                "bos_token_id": self.bos_token_id, "has_fim_tokens": self.has_fim_tokens,
                "fim_tokens": self.fim_tokens,
                # A template that writes <think> belongs to a reasoning model: parse its thoughts out.
                "reasoning": any("<think>" in t for t in templates),
                "tool_format": detect_tool_format(tool_template)}

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        text = self.renderer.render(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
        # The template already wrote BOS and the turn markers: add no special tokens of our own.
        return text, self.encode(text, add_special_tokens=False)

    def encode_fim(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt (prefix-suffix-middle order): the model writes what goes between."""
        if self.fim_tokens is None:
            raise ValueError("this model has no fill-in-the-middle tokens, so `suffix` cannot be used")
        pre, suf, mid = self.fim_tokens
        return self.encode(f"{pre}{prefix}{suf}{suffix}{mid}", add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is not None and (self._snapshot or not add_special_tokens):
            if len(text) > LARGE_INPUT:
                # encode holds the GIL throughout (seconds for megabytes: every other thread of the replica
                # stalls), the batch encoders release it while they work.
                return self._encode_ids([text], add_special_tokens=add_special_tokens)[0].ids
            # Straight to Rust: transformers' encode re-checks its arguments and the backend's
            # truncation and padding state on every call (2-3x the cost of the encoding itself here).
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts in one call (the backend encodes them in parallel)."""
        if self._backend is not None and (self._snapshot or not add_special_tokens):
            return [e.ids for e in self._encode_ids(texts, add_special_tokens=add_special_tokens)]
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None and len(ids) > LARGE_IDS:  # as encode: decode_batch releases the GIL
            return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each token decoded alone (a partial UTF-8 character shows as U+FFFD), for logprobs."""
        if self._backend is not None:
            return self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        """Raw bytes of each token (a token may hold part of a UTF-8 character)."""
        out = []
        byte_decoder = _gpt2_byte_decoder()
        for tid, piece in zip(ids, self.tokenizer.convert_ids_to_tokens(ids), strict=True):
            piece = piece or ""
            if tid in self._added:  # added tokens are stored as their text, not byte-mapped
                out.append(list(piece.encode("utf-8")))
            elif self._byte_level and all(c in byte_decoder for c in piece):
                out.append([byte_decoder[c] for c in piece])
            elif m := _BYTE_PIECE.fullmatch(piece):  # SentencePiece byte fallback
                out.append([int(m.group(1), 16)])
            else:  # SentencePiece word piece: '▁' is a space
                out.append(list(piece.replace("\u2581", " ").encode("utf-8")))
        return out


async def _off_loop(large: bool, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn's result; computed in a thread when its input is large, so that the replica's event loop serves the
    other calls meanwhile (a small one runs inline: the thread hop would cost more than it does)."""
    return await asyncio.to_thread(fn, *args, **kwargs) if large else fn(*args, **kwargs)


@serve.deployment(name="tokenizer", max_ongoing_requests=1000)
class TokenizerDeployment:
    """Rendering and tokenizing for every model of the app on their own CPU replicas, off the model
    replicas' cores; each call names its model (a served model name). Every method is async, and only a
    large input (or the sandbox) leaves the event loop: Serve runs plain methods in a thread pool, one more
    thread hop per call."""

    def __init__(self, model_paths: dict[str, str], priority: ServingPriority | None = None,
                 tracing: TracingConfig | None = None):
        configure(tracing, "tokenizer")  # spans of the renders that arrive with a traceparent
        # This node's copies of what a tokenizer reads (a model directory's weights stay with the model replicas).
        model_paths = {name: resolve_model_path(path, part="tokenizer") for name, path in model_paths.items()}
        self.services = {name: TokenizerService(path) for name, path in model_paths.items()}
        warm_chat_templates()  # the renderer's import, here rather than in the first request
        # Only now: the first token needs this replica as much as the engine, so its start-up (importing
        # transformers, loading the tokenizer) runs at normal priority beside the engine's.
        (priority or ServingPriority()).step_back()
        # Each sandbox's process starts with the first request template for its model.
        self.sandboxes = {name: TemplateSandbox(path) for name, path in model_paths.items()}
        # Renders with the models' own templates for an ingress on this node, without Serve's per-call cost.
        self.channel = RenderServer(self.services)

    def __del__(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()

    async def render_endpoint(self, model: str) -> dict:
        """Where this replica's render channel listens (rayllm.serve.render_channel); it serves every model."""
        self.service(model)
        return {"node_id": ray.get_runtime_context().get_node_id(), "path": self.channel.path}

    def service(self, model: str) -> TokenizerService:
        try:
            return self.services[model]
        except KeyError:
            raise ValueError(f"no tokenizer for model {model!r}") from None

    async def info(self, model: str) -> dict:
        return self.service(model).info()

    async def encode(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        return await _off_loop(len(text) > LARGE_INPUT, self.service(model).encode, text, add_special_tokens)

    async def encode_batch(self, model: str, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Every prompt of a request in one round trip (each call through a handle costs far more than encoding)."""
        large = sum(map(len, texts)) > LARGE_INPUT
        return await _off_loop(large, self.service(model).encode_batch, texts, add_special_tokens)

    async def encode_fim(self, model: str, prefix: str, suffix: str) -> list[int]:
        large = len(prefix) + len(suffix) > LARGE_INPUT
        return await _off_loop(large, self.service(model).encode_fim, prefix, suffix)

    async def decode(self, model: str, ids: list[int], skip_special_tokens: bool = True) -> str:
        return await _off_loop(len(ids) > LARGE_IDS, self.service(model).decode, ids, skip_special_tokens)

    async def token_pieces(self, model: str, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry ("Ġword", not the text it decodes to), as transformers'
        convert_ids_to_tokens: /tokenize's `token_strs`."""
        return await _off_loop(len(ids) > LARGE_IDS, self.service(model).tokenizer.convert_ids_to_tokens, ids)

    async def render_chat_batch(self, model: str,
                                calls: list[tuple[list[dict], dict]]) -> list[tuple[str, list[int]] | Exception]:
        """Several requests' renders with the model's own template in one round trip (render_chat's keyword
        arguments but chat_template; rayllm.serve.render_batcher). A request's error is returned in its place:
        the client's as its ValueError, a fault of ours as a RuntimeError; the others render all the same."""
        service = self.service(model)
        out: list[tuple[str, list[int]] | Exception] = []
        for messages, kw in calls:
            try:
                with remote_span("tokenizer.render", kw.pop("traceparent", None), **{"gen_ai.request.model": model}):
                    large = json_size([messages, kw]) > LARGE_INPUT
                    out.append(await _off_loop(large, service.render_chat, messages, **kw))
            except ValueError as exc:
                out.append(exc)
            except Exception as exc:  # a plain RuntimeError in its place: it pickles, whatever the original held
                log.exception("render_chat_batch: rendering a request for %r failed", model)
                out.append(RuntimeError(f"render failed: {type(exc).__name__}: {exc}"))
        return out

    async def render_chat(self, model: str, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, chat_template: str | None = None,
                          chat_template_kwargs: dict | None = None,
                          tools: list[dict] | None = None, traceparent: str | None = None) -> tuple[str, list[int]]:
        """The model's template renders here; a request's own (the ingress lets one through only when the
        operator allows it) renders in the sandbox, off this replica's event loop."""
        service = self.service(model)
        kw = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                  chat_template_kwargs=chat_template_kwargs, tools=tools)
        with remote_span("tokenizer.render", traceparent, **{"gen_ai.request.model": model}):
            if chat_template is None:
                return await _off_loop(json_size([messages, kw]) > LARGE_INPUT, service.render_chat, messages, **kw)
            text = await self.sandboxes[model].render_async(messages, chat_template=chat_template, **kw)
            return text, await _off_loop(len(text) > LARGE_INPUT, service.encode, text, False)
