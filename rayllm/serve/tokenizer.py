"""Tokenizer and chat template: rendering and tokenizing (detokenizing lives in rayllm.serve.detokenizer).

`TokenizerService` is plain Python (testable without Ray); `TokenizerDeployment` serves one per model
of the app with its own CPU replicas. Detokenizing (`rayllm.serve.detokenizer`) runs beside the engine in the model deployment.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import shutil
import tempfile

import ray
from ray import serve
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rayllm.platforms.cpu.priority import lower_process_priority
from rayllm.protocol.messages import text_of
from rayllm.protocol.tools import detect_tool_format, inline_tools, template_knows_tools
from rayllm.serve.detokenizer import fast_backend
from rayllm.serve.render_channel import RenderServer
from rayllm.serve.template_sandbox import TemplateSandbox

# Roles some chat templates do not know, mapped onto ones they do.
ROLE_FALLBACK = {"developer": "system", "function": "tool"}

# Keys of chat_template_kwargs that would clash with our own arguments to apply_chat_template.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "return_dict", "return_tensors", "chat_template", "tools",
     "add_generation_prompt", "continue_final_message", "padding", "truncation", "max_length"}
)

# Fill-in-the-middle token spellings: StarCoder/SantaCoder style and Qwen2.5-Coder style.
FIM_TOKEN_SETS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))

# End-of-turn tokens of common chat formats, stopped on besides the tokenizer's EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<end_of_turn>")

# Marks the end of the final message's content when continuing it (cut point in the rendered text).
_CONTINUE_SENTINEL = "\x00<continue-final-message>\x00"


def _gguf_tokenizer_cache(model_path: str) -> str:
    """Where the tokenizer rebuilt from this GGUF file is kept: per file (path, size, mtime) and transformers
    version, under the user's cache dir (TOKENIZER_CACHE overrides)."""
    import hashlib

    import transformers

    st = os.stat(model_path)
    key = f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    root = os.environ.get("TOKENIZER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rayllm-tokenizers")
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:24])


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """A GGUF file (tokenizer rebuilt from its metadata by transformers) or a Hugging Face directory.

    Rebuilding from GGUF metadata takes seconds of CPU in every process that loads it (each replica, each
    template sandbox); the result is saved once as a Hugging Face tokenizer directory and loaded from there."""
    if not model_path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(model_path)
    cached = _gguf_tokenizer_cache(model_path)
    if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
        tok = _tokenizer_from_gguf(model_path)
        tmp = None
        try:  # written beside, then renamed: concurrent loaders never see a partial directory
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
            tok.save_pretrained(tmp)
            os.rename(tmp, cached)
        except OSError:  # a read-only home (this rebuilt one serves), or another process renamed first
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isfile(os.path.join(cached, "tokenizer.json")):
                return tok
    # Every process loads the same saved directory, the first one included.
    return AutoTokenizer.from_pretrained(cached)


def _tokenizer_from_gguf(model_path: str) -> PreTrainedTokenizerBase:
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    if not getattr(tok, "chat_template", None):
        # Older transformers did not copy `tokenizer.chat_template` from the GGUF metadata.
        from gguf import GGUFReader  # numpy only, no torch

        field = GGUFReader(model_path).fields.get("tokenizer.chat_template")
        if field is not None:
            tok.chat_template = field.contents()
    return tok


def _tool_calls(calls: list[dict]) -> list[dict]:
    """HF templates expect `arguments` as a mapping (they `tojson` it); OpenAI sends a JSON string."""
    out = []
    for call in calls:
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
            except json.JSONDecodeError:
                pass  # leave malformed arguments as the client sent them
        out.append(call)
    return out


class ChatRenderer:
    """Renders OpenAI-shaped messages with the model's (or a request's) jinja chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.default_template: str | None = getattr(tokenizer, "chat_template", None) or None

    @staticmethod
    def _known_roles(template: str) -> set[str]:
        return {r for r in ROLE_FALLBACK if f"'{r}'" in template or f'"{r}"' in template}

    def _messages(self, messages: list[dict], template: str) -> list[dict]:
        known = self._known_roles(template)
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be an object with a role")
            m = dict(m)
            # Templates concatenate content; None (assistant with tool_calls) renders as empty.
            m["content"] = text_of(m.get("content"))
            if m["role"] in ROLE_FALLBACK and m["role"] not in known:
                m["role"] = ROLE_FALLBACK[m["role"]]
            if m.get("tool_calls"):
                m["tool_calls"] = _tool_calls(m["tool_calls"])
            out.append(m)
        return out

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        template = chat_template or self.default_template
        if not template:
            raise ValueError("this model has no chat template; pass chat_template or use /v1/completions")
        if not messages:
            raise ValueError("messages must not be empty")
        msgs = self._messages(messages, template)
        if not template_knows_tools(template) and (
            tools or any(m.get("tool_calls") or m.get("function_call") or m["role"] == "tool" for m in msgs)
        ):
            # A template without tool support (SmolLM2's): offer the tools and replay the calls as text.
            msgs, tools = inline_tools(msgs, tools), None
        if continue_final_message:
            if msgs[-1]["role"] != "assistant":
                raise ValueError("continue_final_message needs the last message to be from the assistant")
            final = msgs[-1]["content"]
            msgs[-1] = {**msgs[-1], "content": final + _CONTINUE_SENTINEL}
        kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
        try:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=template, tools=tools, **kwargs)
        except Exception as exc:  # jinja syntax errors, undefined variables, raise_exception() alike
            raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise ValueError("chat template did not render to text")
        if continue_final_message:
            # Cut right after the final content, dropping the template's end-of-turn tokens (as vLLM);
            # the sentinel survives templates that rewrite content (strip, split on think tags).
            cut = text.rfind(_CONTINUE_SENTINEL)
            if cut < 0:
                raise ValueError("the chat template dropped the final assistant message; cannot continue it")
            text = text[:cut]
        return text


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
        self.tokenizer = load_tokenizer(model_path)
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

    def info(self) -> dict:
        template = self.renderer.default_template or ""
        return {"vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids,
                "bos_token_id": self.bos_token_id, "has_fim_tokens": self.has_fim_tokens,
                "fim_tokens": self.fim_tokens,
                # A template that writes <think> belongs to a reasoning model: parse its thoughts out.
                "reasoning": "<think>" in template,
                "tool_format": detect_tool_format(template)}

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
        if self._backend is not None and not add_special_tokens:
            # Straight to Rust: transformers' encode re-checks its arguments and the backend's
            # truncation and padding state on every call (2-3x the cost of the encoding itself here).
            return self._backend.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts in one call (the backend encodes them in parallel)."""
        if self._backend is not None and not add_special_tokens:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
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


@serve.deployment(name="tokenizer", max_ongoing_requests=1000)
class TokenizerDeployment:
    """Rendering and tokenizing for every model of the app on their own CPU replicas, off the model
    replicas' cores; each call names its model (a served model name). Every method is async though only
    the sandbox path awaits: Serve runs plain methods in a thread pool, one more thread hop per call."""

    def __init__(self, model_paths: dict[str, str], serving_nice: int = 0):
        lower_process_priority(serving_nice)
        self.services = {name: TokenizerService(path) for name, path in model_paths.items()}
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
        return self.service(model).encode(text, add_special_tokens)

    async def encode_batch(self, model: str, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Every prompt of a request in one round trip (each call through a handle costs far more than encoding)."""
        return self.service(model).encode_batch(texts, add_special_tokens)

    async def encode_fim(self, model: str, prefix: str, suffix: str) -> list[int]:
        return self.service(model).encode_fim(prefix, suffix)

    async def decode(self, model: str, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.service(model).decode(ids, skip_special_tokens)

    async def render_chat_batch(self, model: str,
                                calls: list[tuple[list[dict], dict]]) -> list[tuple[str, list[int]] | ValueError]:
        """Several requests' renders with the model's own template in one round trip (render_chat's keyword
        arguments but chat_template; rayllm.serve.render_batcher): a client's error is returned in its place."""
        service = self.service(model)
        out: list[tuple[str, list[int]] | ValueError] = []
        for messages, kw in calls:
            try:
                out.append(service.render_chat(messages, **kw))
            except ValueError as exc:
                out.append(exc)
        return out

    async def render_chat(self, model: str, messages: list[dict], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, chat_template: str | None = None,
                          chat_template_kwargs: dict | None = None,
                          tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The model's template renders here; a request's own (the ingress lets one through only when the
        operator allows it) renders in the sandbox, off this replica's event loop."""
        service = self.service(model)
        kw = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                  chat_template_kwargs=chat_template_kwargs, tools=tools)
        if chat_template is None:
            return service.render_chat(messages, **kw)
        text = await asyncio.to_thread(self.sandboxes[model].render, messages, chat_template=chat_template, **kw)
        return text, service.encode(text, add_special_tokens=False)
