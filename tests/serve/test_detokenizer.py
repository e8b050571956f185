"""stop_regex under RE2 (rayllm.serve.detokenizer), against Python's `re` as the reference, with the real
SmolLM2 tokenizer."""

from __future__ import annotations

import re

import pytest

from rayllm.serve.detokenizer import REGEX_WINDOW_CHARS, IncrementalDetokenizer
from rayllm.serve.tokenizer import TokenizerService

TEXT = "Grüße aus Köln — 東京タワー 🎉 costs 1234 yen, naïve café 5678 END"


@pytest.fixture(scope="module")
def svc(gguf_path) -> TokenizerService:
    return TokenizerService(gguf_path)


def feed(det: IncrementalDetokenizer, ids: list[int]) -> tuple[str, str | None]:
    out, matched = [], None
    for tid in ids:
        text, m = det.add([tid])
        out.append(text)
        matched = matched or m
    if matched is None:
        out.append(det.flush())
    return "".join(out), matched


@pytest.mark.parametrize("pattern", [r"\d{4} yen", r"caf.", r"caf\pL", r"タ\S+ ", r"(?i)köln", r"[^\x00-\x7f]{3}", r"END$"])
def test_re2_matches_where_python_re_does_on_non_ascii_text(svc, pattern):
    """Match positions are characters, not UTF-8 bytes: the text before the stop is what `re` finds."""
    ref = re.search(pattern.replace(r"\pL", "[^\\W\\d_]"), TEXT)  # re has no \pL
    assert ref is not None
    text, matched = feed(IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(pattern,)),
                         svc.encode(TEXT, add_special_tokens=False))
    assert matched == ref.group(0)
    assert text == TEXT[: ref.start()]


def test_catastrophic_pattern_matches_like_re_on_a_short_run(svc):
    """`(a+)+b` backtracks exponentially in `re` on a run of a's with no b; RE2 answers the same."""
    ids = svc.encode("x" + "a" * 18 + "c aab", add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"(a+)+b",))
    text, matched = feed(det, ids)
    ref = re.search(r"(a+)+b", "x" + "a" * 18 + "c aab")
    assert (text, matched) == ("x" + "a" * 18 + "c ", ref.group(0))


def test_long_runs_of_a_never_match_and_the_text_streams(svc):
    """Thousands of a's against `(a+)+b`: no match, every character streams out (the held-back tail
    included at the end), and the searched window stays bounded."""
    ids = svc.encode("a" * 4000, add_special_tokens=False) * 6
    det = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(r"(a+)+b", r"(x+x+)+y"))
    text, matched = feed(det, ids)
    assert matched is None and text == "a" * 24000
    assert len(det._text) <= 2 * REGEX_WINDOW_CHARS


class CountingRegex:
    """A compiled RE2 pattern that records the length of every text it is asked to search."""

    def __init__(self, rx) -> None:
        self.rx, self.lengths = rx, []

    def search(self, text: str):
        self.lengths.append(len(text))
        return self.rx.search(text)


def test_every_search_is_bounded_by_the_window_and_a_match_inside_it_stops(svc):
    """A pattern whose RE2 DFA gives up on long inputs (bounded repeats in an alternation) is only ever
    run over the output's last REGEX_WINDOW_CHARS (plus the held-back tail), however long the output;
    a match that fits in the window still stops it, where `re` finds it."""
    pattern = r"(?:a.{40}b|c.{40}d|e.{40}f)+g"
    filler = "".join("abcdef"[(i * 7 + i // 5) % 6] for i in range(6000))
    tail = "a" + "x" * 40 + "bg"  # one repetition, then g: a match of 43 characters at the very end
    ids = svc.encode(filler + " " + tail, add_special_tokens=False)
    det = IncrementalDetokenizer(svc.tokenizer, [], stop_regex=(pattern,))
    det.stop_regex = tuple(CountingRegex(rx) for rx in det.stop_regex)
    text, matched = feed(det, ids)
    ref = re.search(pattern, filler + " " + tail)
    assert ref is not None and matched == ref.group(0) and text == (filler + " " + tail)[: ref.start()]
    lengths = det.stop_regex[0].lengths
    assert len(lengths) > 1000 and max(lengths) <= REGEX_WINDOW_CHARS + 64 + 16  # window + hold-back + a token


def test_patterns_re2_cannot_run_in_linear_time_are_refused():
    from rayllm.protocol.request_models import compile_regexes

    for bad in (r"(\w)\1", r"(?<=a)b", r"(?=x)y"):
        with pytest.raises(ValueError, match="not a valid RE2"):
            compile_regexes(bad)
    with pytest.raises(ValueError, match="at most"):
        compile_regexes(["a"] * 5)
    with pytest.raises(ValueError, match="characters"):
        compile_regexes("a" * 10_000)
