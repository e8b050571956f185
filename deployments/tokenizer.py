"""Tokenizer and chat template: rendering, tokenizing, and incremental detokenizing with stop strings.

`TokenizerService` is plain Python (testable without Ray); `TokenizerDeployment` serves it with its
own CPU replicas. `IncrementalDetokenizer` runs beside the engine in the model deployment.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from ray import serve

# Text held back while stop_regex is set (SGLang bounds regex stops similarly); longer matches
# still stop generation, but their start may already have been streamed.
REGEX_HOLDBACK_CHARS = 64

# Roles some chat templates do not know, mapped onto ones they do.
ROLE_FALLBACK = {"developer": "system", "function": "tool"}


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    if model_path.endswith(".gguf"):
        tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
        if not getattr(tok, "chat_template", None):
            from model_parallel.loader import open_gguf

            field = open_gguf(model_path).fields.get("tokenizer.chat_template")
            if field is not None:
                tok.chat_template = field.contents()
        return tok
    return AutoTokenizer.from_pretrained(model_path)


def _text_of(content: Any) -> str | None:
    """OpenAI content: a string, None, or a list of parts; text parts are joined."""
    if content is None or isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise ValueError(f"{part.get('type')} content is not supported by this text-only model")
        parts.append(part.get("text", ""))
    return "".join(parts)


class ChatRenderer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) or ""
        self.known_roles = {r for r in ("developer", "function", "tool") if f"'{r}'" in template}

    def _messages(self, messages: list[dict]) -> list[dict]:
        out = []
        for m in messages:
            m = dict(m)
            m["content"] = _text_of(m.get("content"))
            role = m.get("role")
            if role in ROLE_FALLBACK and role not in self.known_roles:
                m["role"] = ROLE_FALLBACK[role]
            if m["content"] is None:
                m["content"] = ""
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
        msgs = self._messages(messages)
        if continue_final_message and (not msgs or msgs[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        try:
            text = self.tokenizer.apply_chat_template(
                msgs,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja errors and template-raised exceptions alike
            raise ValueError(f"chat template failed: {exc}") from None
        if continue_final_message:
            # Cut right after the final message's content, leaving the assistant turn open.
            final = msgs[-1]["content"]
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ValueError("could not locate the final assistant message in the rendered prompt")
            text = text[: cut + len(final)]
        return text


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back what could still be a stop string.

    Decoding uses a sliding window (prefix/read offsets): only the last few tokens are re-decoded
    per step, and text ending in an incomplete UTF-8 character (U+FFFD) waits for the next token.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        stop_regex: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.spaces_between_special = spaces_between_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.stop_regex = tuple(re.compile(r) for r in stop_regex)
        self.include_stop = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # A few prompt tokens of context make the first output token's leading space decode right.
        self.ids: list[int] = list(prompt_token_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text decoded so far
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special,
            spaces_between_special_tokens=self.spaces_between_special,
            clean_up_tokenization_spaces=False,
        )

    def _append_tokens(self, token_ids: list[int]) -> None:
        for tid in token_ids:
            self.ids.append(tid)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string or regex match that ended the output, if any)."""
        if self.stopped:
            return "", None
        start_search = max(0, self.emitted - self.max_stop_len)
        self._append_tokens(token_ids)
        for s in self.stop:
            idx = self.text.find(s, start_search)
            if idx >= 0:
                return self._finish(idx, idx + len(s), s)
        for rx in self.stop_regex:
            m = rx.search(self.text)
            if m:
                return self._finish(m.start(), m.end(), m.group(0))
        # Hold back a tail that could be the start of a stop string.
        safe = len(self.text)
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    safe = min(safe, len(self.text) - k)
                    break
        if self.stop_regex:
            # A regex match can begin anywhere; keep a window unsent so typical matches are cut cleanly.
            safe = min(safe, len(self.text) - REGEX_HOLDBACK_CHARS)
        out = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted = max(safe, self.emitted)
        return out, None

    def _finish(self, start: int, end: int, matched: str) -> tuple[str, str]:
        cut = end if self.include_stop else start
        out = self.text[self.emitted : max(cut, self.emitted)]
        self.emitted = max(cut, self.emitted)
        self.stopped = True
        return out, matched

    def flush(self) -> str:
        """Text held back for a possible stop string, when generation ends without one."""
        if self.stopped:
            return ""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class TokenizerService:
    def __init__(self, model_path: str):
        self.tokenizer = load_tokenizer(model_path)
        self.renderer = ChatRenderer(self.tokenizer)
        tok = self.tokenizer
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        for special in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(special)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
                eos.add(tid)
        self.eos_token_ids = sorted(eos)
        self.bos_token_id = tok.bos_token_id
        self.vocab_size = len(tok)
        vocab = tok.get_vocab()
        self.has_fim_tokens = all(t in vocab for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))

    def info(self) -> dict:
        return {"vocab_size": self.vocab_size, "eos_token_ids": self.eos_token_ids,
                "bos_token_id": self.bos_token_id, "has_fim_tokens": self.has_fim_tokens}

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str, list[int]]:
        text = self.renderer.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        # The template already wrote the special tokens.
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def token_bytes(self, ids: list[int]) -> list[list[int]]:
        """Raw bytes of each token (byte-level BPE: a token may hold part of a UTF-8 character)."""
        out = []
        byte_decoder = getattr(self.tokenizer, "byte_decoder", None) or _gpt2_byte_decoder()
        for piece in self.tokenizer.convert_ids_to_tokens(ids):
            try:
                out.append([byte_decoder[c] for c in piece])
            except KeyError:  # not a byte-level piece (special token, sentencepiece)
                out.append(list(piece.encode("utf-8")))
        return out


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


@serve.deployment(name="tokenizer", max_ongoing_requests=1000)
class TokenizerDeployment(TokenizerService):
    """Rendering and tokenizing on their own CPU replicas, off the model replicas' cores."""
