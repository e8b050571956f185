"""rayllm.protocol.structured's literal-choice recognition and choice picking (the serve path: tests/serve/test_guided_choice.py)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from rayllm.protocol.structured import choice_grammar, literal_choices, pick_choice
from rayllm.schema.sampling_params import GuidedSpec


@pytest.mark.parametrize("choices", [["yes", "no"], ['say "hi"', "a | b", "back\\slash", "ünï", ""], ["x", "x", "y"]])
def test_guided_choice_grammar_round_trips(choices):
    assert literal_choices(GuidedSpec("ebnf", choice_grammar(choices), "guided_choice")) == list(dict.fromkeys(choices))


@pytest.mark.parametrize("pattern", ["yes|no", "(?:yes|no|maybe)", "(red|green)", r"a\.b|c\|d", r"1\+1|2"])
def test_a_regex_of_literals_gives_exactly_the_strings_it_matches(pattern):
    found = literal_choices(GuidedSpec("regex", pattern, "regex"))
    assert found is not None
    for s in found:  # each is a full match of the pattern (the regex engine is the reference)
        assert re.fullmatch(pattern, s)
    probes = found + [s + "x" for s in found] + [s[:-1] for s in found if s]
    assert {p for p in probes if re.fullmatch(pattern, p)} == set(found)


@pytest.mark.parametrize("pattern", ["a.b", r"\d+|x", "(a)|(b)", "[ab]", "a*", "yes|no?", "(?i:yes)"])
def test_other_regexes_are_not_literal_choices(pattern):
    assert literal_choices(GuidedSpec("regex", pattern, "regex")) is None


def test_other_grammars_are_not_literal_choices():
    assert literal_choices(GuidedSpec("ebnf", 'root ::= "a" | "b"', "ebnf")) is None
    assert literal_choices(GuidedSpec("json_schema", "{}", "guided_json")) is None
    assert literal_choices(None) is None


def test_pick_choice_greedy_and_seeded_sampling_follow_the_softmax():
    scores = [-1.0, -2.5, -0.2]
    assert pick_choice(scores, 0.0, None) == 2
    assert [pick_choice(scores, 0.7, s) for s in range(50)] == [pick_choice(scores, 0.7, s) for s in range(50)]
    draws = Counter(pick_choice(scores, 1.0, s) for s in range(4000))
    z = sum(math.exp(s) for s in scores)
    for k, s in enumerate(scores):
        assert draws[k] / 4000 == pytest.approx(math.exp(s) / z, abs=0.03)
