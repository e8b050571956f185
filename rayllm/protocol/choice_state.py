"""What the ingress knows of a generation while it streams: one ChoiceState per choice, fed once per delta.

The SSE chunks, the whole response body, the stored completion (`store`) and the request's metrics are
all read from this state, so they cannot disagree (and nothing is tracked twice).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable
from typing import Any

from rayllm.protocol.chat_output import ChatOutputParser, merge_deltas
from rayllm.protocol.io_struct import GenerationDelta

ParserFactory = Callable[[], ChatOutputParser]


class LegacyLogprobs:
    """Completions' legacy logprobs (parallel lists) with text_offset, built across deltas."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, entries: list[dict | None], offset: int) -> None:
        """Tokens whose text starts at `offset` in the choice's text, one after another."""
        for e in entries:
            if e is None:  # a first prompt token reported without its text: null logprob, empty token
                e = {"token": "", "logprob": None, "top_logprobs": []}
            self.tokens.append(e["token"])
            self.token_logprobs.append(e["logprob"])
            # As OpenAI and vLLM: the chosen token is always among its alternatives (so logprobs=0 gives it alone).
            top = {e["token"]: e["logprob"]} if e["logprob"] is not None else {}
            for t in e.get("top_logprobs") or []:
                top.setdefault(t["token"], t["logprob"])
            self.top_logprobs.append(top or None)
            self.text_offset.append(offset)
            offset += len(e["token"])

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


class ParsedPieces(list[dict[str, Any]]):
    """A delta's pieces from its choice's output parser (delta dicts, sent as they are), and `text_logprobs`: the
    logprob entries of the tokens just found to be answer text (the Responses API's output_text logprobs)."""

    def __init__(self, pieces: list[dict[str, Any]], text_logprobs: list[dict]) -> None:
        super().__init__(pieces)
        self.text_logprobs = text_logprobs


class TextTokens:
    """Which generated tokens wrote the answer's text, not its reasoning, think tags or tool calls.

    Each token is placed in the raw output: a delta's text split by its tokens' own strings (tokens whose text
    the detokenizer held back go with the next delta that has text). Once the parser has decided those
    characters, a token is the answer's when they overlap the content it emitted (ChatOutputParser.text_spans);
    a token without text (an end-of-sequence token) goes with the character before it.
    """

    def __init__(self) -> None:
        self.carry: list[dict] = []
        self.placed: deque[tuple[int, int, dict]] = deque()  # (start, end, entry), not yet decided

    def add(self, start: int, text: str, entries: list[dict], final: bool) -> None:
        """A delta's tokens, its text starting at `start` in the raw output."""
        tokens = self.carry + entries
        if not text and not final:
            self.carry = tokens
            return
        self.carry = []
        end = start + len(text)
        for i, e in enumerate(tokens):  # (the last token takes what the others' strings left)
            stop = end if i == len(tokens) - 1 else min(start + len(e["token"]), end)
            self.placed.append((start, stop, e))
            start = stop

    def take(self, spans: list[list[int]], decided: int) -> list[dict]:
        """The answer's tokens among those placed up to `decided`, in order."""
        out = []
        while self.placed and self.placed[0][1] <= decided:
            start, end, e = self.placed.popleft()
            first = min(start, end - 1)  # a token without text: the character before it
            i = bisect_right(spans, end - 1, key=lambda s: s[0]) - 1  # the last span starting before its end
            if i >= 0 and spans[i][1] > first:
                out.append(e)
        return out


class ChoiceState:
    """One choice so far: its text, token count, logprobs, finish, and its output parser's state.

    `add` returns what the delta contributes to the wire: the parser's pieces (content / reasoning /
    tool-call deltas) when the choice is parsed, else None (the delta's text is content as is).
    """

    def __init__(self, index: int, parser: ChatOutputParser | None = None, legacy_logprobs: bool = False) -> None:
        self.index = index
        self.parser = parser
        self.texts: list[str] = []  # the echoed prompt (completions' echo), then every delta's text
        self.length = 0  # characters of text so far
        self.offset = 0  # where the latest delta's text starts (completions' text_offset)
        self.completion_tokens = 0
        self.logprobs: list[dict] = []  # chat-shaped entries of the generated tokens
        self.legacy = LegacyLogprobs() if legacy_logprobs else None  # completions: prompt (echo) and output
        self.hidden_states: list[list[float]] = []
        self.token_ids: list[int] = []  # generated so far (vLLM's return_token_ids)
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None
        self.pieces: list[dict[str, Any]] = []  # every parser piece so far (the message, merged)
        self.text_tokens = TextTokens()
        self.deltas = 0  # deltas added (a chat stream opens each choice with its role)

    def add(self, d: GenerationDelta) -> ParsedPieces | None:
        self.deltas += 1
        if d.prompt_text is not None:  # completions' echo: the prompt is the start of the choice's text
            self.texts.append(d.prompt_text)
            if self.legacy is not None:
                self.legacy.add(d.prompt_logprobs or [], self.length)
            self.length += len(d.prompt_text)
        self.offset = self.length
        self.texts.append(d.text)
        self.length += len(d.text)
        self.completion_tokens = d.completion_tokens
        self.token_ids.extend(d.token_ids)
        if d.logprobs:
            self.logprobs.extend(d.logprobs)
            if self.legacy is not None:
                self.legacy.add(d.logprobs, self.offset)
        if d.hidden_states:
            self.hidden_states.extend(d.hidden_states)
        if d.finish_reason is not None:
            self.finish_reason, self.matched_stop = d.finish_reason, d.matched_stop
        if self.parser is None:
            return None
        start = self.parser.fed
        pieces = self.parser.feed(d.text) if d.text else []
        if d.finish_reason is not None:
            pieces += self.parser.finish()
        self.pieces += pieces
        self.text_tokens.add(start, d.text, d.logprobs or [], d.finish_reason is not None)
        return ParsedPieces(pieces, self.text_tokens.take(self.parser.text_spans, self.parser.decided))

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def message(self) -> dict[str, Any]:
        """The whole assistant message's fields: content, and reasoning_content / tool_calls when parsed."""
        return merge_deltas(self.pieces) if self.parser is not None else {"content": self.text}

    def reason(self) -> str | None:
        """The finish reason a client sees (a choice that called tools finished with `tool_calls`)."""
        return self.parser.finish_reason(self.finish_reason) if self.parser is not None else self.finish_reason


class GenerationState:
    """A request's choices and usage. A prompt (and its cache hits) counts once however many choices."""

    def __init__(self, n: int = 1, parser_factory: ParserFactory | None = None,
                 legacy_logprobs: bool = False) -> None:
        self.n = max(1, n)
        self.parser_factory = parser_factory
        self.legacy_logprobs = legacy_logprobs
        self.choices: dict[int, ChoiceState] = {}
        self.prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (prompt tokens, cached tokens)
        self.first_token_at: float | None = None  # time.monotonic() of the first generated token

    def add(self, d: GenerationDelta) -> tuple[ChoiceState, ParsedPieces | None]:
        """Feeds one delta to its choice; returns the choice and the delta's parsed pieces (see ChoiceState)."""
        choice = self.choices.get(d.index)
        if choice is None:
            parser = self.parser_factory() if self.parser_factory is not None else None
            choice = self.choices[d.index] = ChoiceState(d.index, parser, self.legacy_logprobs)
        # One cache figure per prompt whatever order its choices ran in: the least any of them found cached (a
        # later choice may find the whole prompt, which an earlier one computed).
        prompt = d.index // self.n
        seen = self.prompts.get(prompt)
        self.prompts[prompt] = (d.prompt_tokens, d.cached_tokens if seen is None else min(seen[1], d.cached_tokens))
        if self.first_token_at is None and d.token_ids:
            self.first_token_at = time.monotonic()
        return choice, choice.add(d)

    def sorted_choices(self) -> list[ChoiceState]:
        return [self.choices[i] for i in sorted(self.choices)]

    @property
    def prompt_tokens(self) -> int:
        return sum(p for p, _ in self.prompts.values())

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    def usage(self) -> dict[str, Any]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c for _, c in self.prompts.values())}}

    def complete(self) -> bool:
        """Every choice ran to a finish other than an abort (a whole generation, which `store` keeps)."""
        return bool(self.choices) and all(c.finish_reason not in (None, "abort") for c in self.choices.values())

    def outcome(self) -> str:
        """How the request ended, for the metrics: the first choice's reason, "abort" if any was aborted."""
        reasons = [c.finish_reason for c in self.choices.values() if c.finish_reason is not None]
        return "abort" if "abort" in reasons else next(iter(reasons), "stop")
