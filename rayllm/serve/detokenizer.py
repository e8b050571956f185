"""Incremental detokenizing with stop strings: token ids in, text deltas out (runs in the model replica)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import re2  # google-re2: linear-time matching, so no pattern can stall the replica's event loop

from rayllm.protocol.holdback import HeldSuffix
from rayllm.protocol.request_models import re2_options

if TYPE_CHECKING:  # transformers (and the torch it pulls in) load with the tokenizer, not with this module
    from transformers import PreTrainedTokenizerBase

# Text held back while stop_regex is set: a regex match can start anywhere, so no exact hold-back
# exists; this window makes typical (short) matches stop cleanly. Longer matches still stop
# generation, but their beginning may already have been streamed.
REGEX_HOLDBACK_CHARS = 64

# Output text stop_regex is matched against: the last this many characters, so a match longer than this is
# not seen. RE2 runs in linear time, but for some patterns (bounded repeats in alternations) its DFA runs
# out of memory on long inputs and falls back to a far slower NFA: a short window keeps every step's search
# small whatever the pattern (docs/benchmarks.md, History 2026-11-26).
REGEX_WINDOW_CHARS = 1024

# Prompt tokens decoded as context before the first output token (as vLLM): a token's leading
# space or a UTF-8 character split across the prompt/output boundary decodes as it would in place.
PROMPT_CONTEXT_TOKENS = 5

# Tokens that may wait for the rest of a UTF-8 character (at most 4 bytes, so 3 byte tokens wait): a run
# of more that still decodes to U+FFFD (lone bytes), or to nothing new (skipped special tokens), is emitted
# as it decodes, so the window, and each step's decode, stays bounded whatever the model writes.
MAX_UNREAD_TOKENS = 4


def fast_backend(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind a fast tokenizer, else None (slow/Python tokenizer)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "decode_batch") else None


def _make_decoder(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    backend = fast_backend(tokenizer)
    if backend is not None:
        # Straight to Rust: ~3x less overhead than tokenizer.decode on this hot path. We never clean up
        # tokenization spaces. spaces_between_special_tokens is a slow-tokenizer option: transformers' fast
        # decode and vLLM's fast detokenizer ignore it, and so do we (streamed text = tokenizer.decode).
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
                             spaces_between_special_tokens=spaces_between_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, holding back what could still be a stop string.

    Decoding uses a sliding window (prefix/read offsets): each step re-decodes only the tokens since
    the last emitted one plus the previous few, and text ending in an incomplete UTF-8 character
    (U+FFFD) waits for the next token (up to MAX_UNREAD_TOKENS). Emitted text is never revisited, so a step is O(new tokens)
    plus the stop search over the held-back tail (and, with stop_regex, a linear-time search of the output's last REGEX_WINDOW_CHARS).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        *,
        stop: tuple[str, ...] = (),
        stop_regex: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self._decode = _make_decoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self.stop = tuple(s for s in stop if s)
        self.stop_regex = tuple(re2.compile(r, re2_options()) for r in stop_regex)
        self.include_stop = include_stop_str_in_output
        self._held = HeldSuffix(self.stop)
        # As vLLM: no stop string or regex match counts until more than min_tokens tokens are out, and then
        # only one ending after the text of the first min_tokens (one may begin in it): after character
        # _stop_after of the output (_chars so far).
        self.min_tokens = min_tokens
        self._num_tokens = 0
        self._chars = self._stop_after = 0
        # Window (vLLM's prefix/read offsets, with the prefix offset kept at 0 by dropping older ids):
        # ids[:read] decoded to prefix_text, already emitted; ids[read:] not yet turned into text.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self._anchor = len(self._ids)  # ids[:anchor]: the latest context that decoded to text
        self._pending = ""  # decoded text not yet returned (possible start of a stop string)
        self._text = ""  # the output's last REGEX_WINDOW_CHARS (at least all of pending), for stop_regex
        self.stopped = False

    def _step(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the newly completed text (vLLM's detokenize_incrementally)."""
        new = []
        for tid in token_ids:
            self._ids.append(tid)
            full = self._decode(self._ids)
            complete = len(full) > len(self._prefix_text) and not full.endswith("\ufffd")
            if complete or len(self._ids) - self._read >= MAX_UNREAD_TOKENS:
                new.append(full[len(self._prefix_text) :])
                # Slide the window: the tokens just read become the next step's context, after the latest
                # context that decoded to text if they decode to none (skipped special tokens): alone, they
                # would decode the next word as the text's first (a SentencePiece `▁word` losing its space).
                read = self._ids[self._read :]
                self._prefix_text = self._decode(read)
                if self._prefix_text:
                    self._ids, self._anchor = read, len(read)
                else:
                    self._ids = self._ids[: self._anchor] + read
                    self._prefix_text = self._decode(self._ids)
                self._read = len(self._ids)
        return "".join(new)

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string or regex match that ended the output, if any)."""
        if self.stopped:
            return "", None
        held = max(0, self.min_tokens - self._num_tokens)  # tokens still before the min_tokens boundary
        self._num_tokens += len(token_ids)
        early = ""
        if held:
            early, _ = self._emit(self._step(token_ids[:held]), final=False, search=False)
            self._stop_after = self._chars
        text, matched = self._emit(self._step(token_ids[held:]), final=False)
        return early + text, matched

    def flush(self) -> str:
        """Held-back text when generation ends without a stop (plus an incomplete last character as U+FFFD)."""
        if self.stopped:
            return ""
        tail = ""
        if self._read < len(self._ids):  # tokens still waiting for the rest of a UTF-8 character
            tail = self._decode(self._ids)[len(self._prefix_text) :]
            self._read = len(self._ids)
        text, _ = self._emit(tail, final=True, search=self._num_tokens > self.min_tokens)
        self.stopped = True
        return text

    def _emit(self, new_text: str, *, final: bool, search: bool = True) -> tuple[str, str | None]:
        if not new_text and not final:
            return "", None
        pending = self._pending + new_text
        self._chars += len(new_text)
        if self.stop_regex:
            self._text += new_text
            if len(self._text) > 2 * REGEX_WINDOW_CHARS:  # trimmed now and then, not on every step
                self._text = self._text[-max(REGEX_WINDOW_CHARS, len(pending)):]
        # The earliest stop wins. With the hold-back below, a stop string can only start inside
        # `pending`, so only that tail is searched.
        best = self._find_stop(pending) if search else None
        if best is not None:
            start, end, matched = best
            out = pending[: max(end if self.include_stop else start, 0)]
            self._pending = ""
            self.stopped = True
            return out, matched
        safe = len(pending) if final else len(pending) - self._holdback(pending)
        out, self._pending = pending[:safe], pending[safe:]
        return out, None

    def _find_stop(self, pending: str) -> tuple[int, int, str] | None:
        """The earliest stop ending after _stop_after: (start, end) in pending coordinates (a regex match may
        start in text already emitted: start < 0), and what matched."""
        floor = self._stop_after - (self._chars - len(pending))  # in pending coordinates
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = pending.find(s, max(0, floor - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(s), s)
        window = self._text[-max(REGEX_WINDOW_CHARS, len(pending)):] if self.stop_regex else ""
        base = len(window) - len(pending)  # pending's offset inside the window
        for rx in self.stop_regex:
            m = rx.search(window)
            while self.min_tokens and m and m.end() <= base + floor:  # within the first min_tokens' text
                m = rx.search(window, m.end() + (m.end() == m.start()))
            if m and (best is None or m.start() - base < best[0]):
                best = (m.start() - base, m.end() - base, m.group(0))
        return best

    def _holdback(self, pending: str) -> int:
        """How many trailing characters of pending could begin a stop string (or a regex match)."""
        hold = min(REGEX_HOLDBACK_CHARS, len(pending)) if self.stop_regex else 0
        return max(hold, self._held(pending))
