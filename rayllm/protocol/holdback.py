"""Text to hold back while streaming: the tail that could still begin a word whose appearance changes what
the text means (a stop string, a `</think>` or tool-call tag), until the next piece of text decides."""

from __future__ import annotations

from collections.abc import Iterable


class HeldSuffix:
    """How many trailing characters of a text are a proper prefix of one of `words` (the longest such).

    Indexed by last character, so a text ending in a character that no word contains costs O(1): this runs
    on every streamed delta.
    """

    def __init__(self, words: Iterable[str]) -> None:
        self._by_last: dict[str, list[tuple[int, str]]] = {}
        for w in words:
            for k in range(len(w) - 1, 0, -1):
                self._by_last.setdefault(w[k - 1], []).append((k, w[:k]))

    def __call__(self, text: str) -> int:
        if not text:
            return 0
        return max((k for k, prefix in self._by_last.get(text[-1], ()) if text.endswith(prefix)), default=0)
