"""rayllm.protocol.structured's literal-choice recognition, the bound on a regex's nesting (grammar_bounds), and
choice picking (the serve path: tests/serve/test_guided_choice.py)."""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest

from rayllm.protocol import limits as L
from rayllm.protocol.errors import APIError
from rayllm.protocol.grammar_bounds import GrammarTooComplex, check_regex
from rayllm.protocol.limits import MAX_REGEX_NESTING
from rayllm.protocol.protocol import ChatCompletionRequest
from rayllm.protocol.structured import (
    choice_grammar,
    guided_spec,
    literal_choices,
    pick_choice,
)
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


@pytest.mark.parametrize("pattern", ["a.b", r"\d+|x", "(a)|(b)", "[ab]", "a*", "yes|no?", "(?i:yes)", "((a|b))"])
def test_other_regexes_are_not_literal_choices(pattern):
    assert literal_choices(GuidedSpec("regex", pattern, "regex")) is None


def test_an_alternation_past_guided_choices_bound_is_sampled_under_the_regex():
    """Each literal costs an engine sequence: 10,000 of them (a 49 Ki-character regex) are not scored one by one."""
    wide = "|".join(str(i) for i in range(L.MAX_GUIDED_CHOICES + 1))
    assert literal_choices(GuidedSpec("regex", wide, "guided_regex")) is None
    at_bound = "|".join(str(i) for i in range(L.MAX_GUIDED_CHOICES))
    assert len(literal_choices(GuidedSpec("regex", at_bound, "guided_regex"))) == L.MAX_GUIDED_CHOICES


def nest(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


@pytest.mark.parametrize(("pattern", "depth"), [("a|b", 0), ("(a(b)c)(d)", 2), (r"\((a)\)", 1), ("[(]([^)(]|[]()])", 1),
                                                (r"[\](]", 0), ("(?:(?P<x>a))", 2), (nest(MAX_REGEX_NESTING), 64)])
def test_regex_nesting_counts_groups_not_escapes_or_classes(pattern, depth):
    more = MAX_REGEX_NESTING - depth
    check_regex("(" * more + pattern + ")" * more)  # at the bound
    with pytest.raises(GrammarTooComplex, match="nests groups more than 64 deep"):
        check_regex("(" * (more + 1) + pattern + ")" * (more + 1))


def test_a_deeply_nested_regex_is_no_literal_and_a_400_naming_the_field():
    """3000 groups deep was a RecursionError in the model replica (a 500); now the ingress refuses it."""
    assert literal_choices(GuidedSpec("regex", nest(3000), "guided_regex")) is None
    assert literal_choices(GuidedSpec("regex", "(" + nest(0) + "|b)", "regex")) == ["a", "b"]
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in (({"guided_regex": nest(3000)}, "guided_regex"), ({"regex": nest(65)}, "regex"),
                        ({"structured_outputs": {"regex": nest(65)}}, "structured_outputs.regex"),
                        ({"response_format": {"type": "regex", "regex": nest(65)}}, "response_format")):
        with pytest.raises(APIError) as e:
            guided_spec(ChatCompletionRequest(model="m", messages=msgs, **body))
        assert (e.value.status_code, e.value.param) == (400, param)
    spec = guided_spec(ChatCompletionRequest(model="m", messages=msgs, guided_regex=nest(MAX_REGEX_NESTING)))
    assert spec is not None and spec.value == nest(MAX_REGEX_NESTING)


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
