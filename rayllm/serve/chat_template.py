"""Tokenizers and chat templates: load a model's tokenizer (a Hugging Face folder or the GGUF's own, saved once
as a folder) and render chat messages with its template (roles, tools, reasoning switches, continuation).
Used by the tokenizer deployment and, for client-supplied templates, by its sandboxed child."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rayllm.loader.model_sources import is_gguf
from rayllm.protocol.limits import loads_bounded
from rayllm.protocol.messages import text_of
from rayllm.protocol.tools import inline_tools, template_knows_tools
from rayllm.serve.rust_tokenizer import RustTokenizer, load_snapshot, save_snapshot, versions

if TYPE_CHECKING:  # imported when a tokenizer loads: importing this module (Serve's app builder does) stays light
    from transformers import PreTrainedTokenizerBase

# How long a process waits for another to build a tokenizer's snapshot before building it too (a first load
# from a GGUF, which rebuilds the tokenizer from its metadata, takes ~10 s on a busy core).
SNAPSHOT_LOCK_TIMEOUT_S = 120.0

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

# Marks the end of the final message's content when continuing it (cut point in the rendered text): transformers'
# own tag, plain ASCII (a `tojson` template writes it as is) with a trailing space that shows whether the template
# trimmed the content (then the content's trailing whitespace goes too, as in transformers).
_CONTINUE_SENTINEL = "CONTINUE_FINAL_MESSAGE_TAG "


def _gguf_tokenizer_cache(model_path: str) -> str:
    """Where the tokenizer rebuilt from this GGUF file is kept: per file (path, size, mtime) and transformers
    version, under the user's cache dir (TOKENIZER_CACHE overrides)."""
    st = os.stat(model_path)
    return _cache_dir(f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}:{versions()['transformers']}")


def _cache_dir(key: str) -> str:
    import hashlib

    root = os.environ.get("TOKENIZER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "rayllm-tokenizers")
    return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:24])


def _snapshot_dir(model_path: str) -> str:
    """Where the tokenizer's snapshot (rayllm.serve.rust_tokenizer) lives: in the GGUF's saved tokenizer
    directory, or for a Hugging Face directory, in one keyed by its path and its small files' sizes and times."""
    if is_gguf(model_path):
        return _gguf_tokenizer_cache(model_path)
    files = []
    for entry in sorted(os.scandir(model_path), key=lambda e: e.name):
        if entry.is_file() and entry.name.endswith((".json", ".jinja", ".model", ".txt", ".tiktoken")):
            st = entry.stat()
            files.append(f"{entry.name}:{st.st_size}:{st.st_mtime_ns}")
    return _cache_dir(f"snapshot:{os.path.realpath(model_path)}:{','.join(files)}:{versions()['transformers']}")


def load_serving_tokenizer(model_path: str) -> PreTrainedTokenizerBase | RustTokenizer:
    """The tokenizer the serving processes use: from its snapshot when there is one (no transformers import,
    rayllm.serve.rust_tokenizer), else through transformers, saving the snapshot for the next start.

    An app's tokenizer replica and its model replicas start together and would all miss a new model's snapshot:
    one process builds it (importing transformers and torch, ~3 s of CPU each) while the others wait for it
    (_snapshot_lock) and then read it."""
    directory = _snapshot_dir(model_path)
    tok = load_snapshot(directory)
    if tok is not None:
        return tok
    with _snapshot_lock(directory):
        tok = load_snapshot(directory)  # built by the process that held the lock before
        if tok is not None:
            return tok
        loaded = load_tokenizer(model_path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError:  # a read-only cache: transformers serves, every time
            return loaded
        save_snapshot(loaded, directory)
        return loaded


@contextlib.contextmanager
def _snapshot_lock(directory: str) -> Iterator[None]:
    """Held while this process builds `directory`'s snapshot: an advisory lock on a file beside it (not in it:
    a GGUF's tokenizer directory is renamed into place). Where the lock cannot be taken (a read-only cache) or
    is held longer than SNAPSHOT_LOCK_TIMEOUT_S, the caller builds without it, as every process did before."""
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        fd = os.open(directory + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + SNAPSHOT_LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another process builds it
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            except OSError:  # no locks on this file system
                break
        yield  # the lock goes with the file descriptor
    finally:
        os.close(fd)


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """A GGUF file (tokenizer rebuilt from its metadata by transformers) or a Hugging Face directory.

    Rebuilding from GGUF metadata takes seconds of CPU in every process that loads it (each replica, each
    template sandbox); the result is saved once as a Hugging Face tokenizer directory and loaded from there."""
    from transformers import AutoTokenizer

    if not is_gguf(model_path):
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    if not getattr(tok, "chat_template", None):
        # Older transformers did not copy `tokenizer.chat_template` from the GGUF metadata.
        from rayllm.loader.gguf_file import GGUFFile  # numpy only, no torch

        template = GGUFFile(model_path).get("tokenizer.chat_template")
        if template is not None:
            tok.chat_template = template
    return tok


def _tool_calls(calls: list[dict]) -> list[dict]:
    """HF templates expect `arguments` as a mapping (they `tojson` it); OpenAI sends a JSON string."""
    out = []
    for call in calls:
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call["function"] = {**fn, "arguments": loads_bounded(fn["arguments"])}
            except ValueError:
                pass  # leave malformed (or too deeply nested) arguments as the client sent them
        out.append(call)
    return out


class ChatRenderer:
    """Renders OpenAI-shaped messages with the model's (or a request's) jinja chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | RustTokenizer):
        self.tokenizer = tokenizer
        # A string, or named templates ({"default": ..., "tool_use": ...}: Hermes-2-Pro, Command-R).
        self.default_template: str | dict[str, str] | None = getattr(tokenizer, "chat_template", None) or None

    def template(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str | None:
        """The template a request renders with, chosen as transformers' get_chat_template does: the request's
        own (or the model's template of that name), else of named ones `tool_use` when tools are given (even
        none), else `default`."""
        own = self.default_template
        if not isinstance(own, dict):
            return chat_template or own
        if chat_template:
            return own.get(chat_template, chat_template)
        if tools is not None and "tool_use" in own:
            return own["tool_use"]
        if "default" not in own:
            raise ValueError(f"this model has several chat templates and none is the default: name one of "
                             f"{sorted(own)} in chat_template")
        return own["default"]

    def templates(self) -> list[str]:
        """Every template of the model (one, several named ones, or none)."""
        own = self.default_template
        return list(own.values()) if isinstance(own, dict) else [own] if own else []

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
        try:
            return self._render(messages, add_generation_prompt, continue_final_message, chat_template,
                                chat_template_kwargs, tools)
        except RecursionError:  # a client's structure nested past what the template (or json) walks: its 400
            raise ValueError("messages nest too deeply to render") from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                chat_template: str | None, chat_template_kwargs: dict | None, tools: list[dict] | None) -> str:
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        template = self.template(chat_template, tools)
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
            msgs[-1] = {**msgs[-1], "content": msgs[-1]["content"] + _CONTINUE_SENTINEL}
        kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
        try:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                      chat_template=template, tools=tools, **kwargs)
        except Exception as exc:  # jinja syntax errors, undefined variables, raise_exception() alike
            raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise ValueError("chat template did not render to text")
        if continue_final_message:
            # Cut right after the final content, dropping the template's end-of-turn tokens (as transformers and
            # vLLM); the tag survives templates that rewrite content (strip, split on think tags).
            cut = text.rfind(_CONTINUE_SENTINEL.rstrip())
            if cut < 0:
                raise ValueError("the chat template dropped the final assistant message; cannot continue it")
            # A template that trimmed the content (its tag lost the space) loses the content's trailing spaces too.
            text = text[:cut] if text.startswith(_CONTINUE_SENTINEL, cut) else text[:cut].rstrip()
        return text
