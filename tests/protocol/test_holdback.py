"""rayllm.protocol.holdback against a brute-force reference: the longest suffix of the text that is a proper prefix of a word."""

from __future__ import annotations

import random

from rayllm.protocol.holdback import HeldSuffix


def reference(text: str, words: list[str]) -> int:
    return max((k for w in words for k in range(1, len(w)) if text.endswith(w[:k])), default=0)


def test_matches_the_reference_on_random_texts():
    rng = random.Random(0)
    for _ in range(2000):
        words = ["".join(rng.choice("ab<>/") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 3))]
        text = "".join(rng.choice("ab<>/x") for _ in range(rng.randint(0, 12)))
        assert HeldSuffix(words)(text) == reference(text, words), (text, words)


def test_tags():
    held = HeldSuffix(["</think>"])
    assert held("reasoning </thi") == 5 and held("</think>") == 0 and held("a <") == 1 and held("") == 0
