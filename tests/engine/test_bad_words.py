"""vLLM's bad_words in the engine (rayllm.engine.engine.banned_next): which token a step must not sample.
The engine end to end against transformers' bad_words_ids: tests/engine/test_engine.py."""

from __future__ import annotations

from rayllm.engine.engine import banned_next

PROMPT = [1, 2, 3]


def test_one_token_words_are_always_banned_and_longer_ones_when_the_output_ends_with_their_start():
    words = ((9,), (4, 5), (6, 7, 8))
    assert banned_next(words, PROMPT, 0) == (9,)
    assert banned_next(words, [*PROMPT, 4], 1) == (9, 5)
    assert banned_next(words, [*PROMPT, 4, 6, 7], 3) == (9, 8)
    assert banned_next(words, [*PROMPT, 6, 7, 4, 4], 4) == (9, 5)


def test_a_word_does_not_start_in_the_prompt():
    assert banned_next(((3, 5),), PROMPT, 0) == ()  # the prompt ends with 3: not the output's start
    assert banned_next(((2, 3, 5),), [*PROMPT, 2, 3], 2) == (5,)
