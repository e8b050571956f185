"""rayllm.serve.detokenizer: stop_regex under RE2 against Python's `re`, min_tokens against vLLM's stop-string
rule, both with the real SmolLM2 tokenizer; runs of skipped special tokens against transformers' decode with a
SentencePiece-style tokenizer."""

from __future__ import annotations

import random
import re

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

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


MIN_TOKENS_TEXT = "Hello, my name is Lee, and I'm a student in the college of engineering"


@pytest.mark.parametrize("stop,regex", [("e", False), ("Lee, and", False), ("ent in", False), (r"e\W", True)])
@pytest.mark.parametrize("chunk", [1, 3])
def test_min_tokens_holds_stops_back_as_vllm(svc, hf_tokenizer, stop, regex, chunk):
    """vLLM's rule (v1 detokenizer, tests/detokenizer/test_min_tokens.py): no stop while the output has at most
    min_tokens tokens; then the first stop ending after those tokens' text (transformers' decode) counts, one
    straddling that boundary included."""
    ids = svc.encode(MIN_TOKENS_TEXT, add_special_tokens=False)
    full = hf_tokenizer.decode(ids)
    straddled = 0
    for min_tokens in range(len(ids)):
        boundary = len(hf_tokenizer.decode(ids[:min_tokens]))
        if regex:
            ref = next((m for m in re.finditer(stop, full) if m.end() > boundary), None)
            first = (ref.start(), ref.group(0)) if ref else None
        else:
            i = full.find(stop, max(0, boundary - len(stop) + 1))
            first = (i, stop) if i >= 0 else None
        straddled += first is not None and first[0] < boundary
        det = IncrementalDetokenizer(svc.tokenizer, [], min_tokens=min_tokens,
                                     **{"stop_regex" if regex else "stop": (stop,)})
        out, matched = [], None
        for k in range(0, len(ids), chunk):
            text, matched = det.add(ids[k : k + chunk])
            out.append(text)
            if matched:
                break
        out.append(det.flush())
        assert ("".join(out), matched) == ((full[: first[0]], first[1]) if first else (full, None)), min_tokens
    assert straddled or len(stop) == 1  # a stop beginning in the first min_tokens' text and ending after it matched


def sentencepiece_tokenizer(decoder) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer (Metaspace `▁` pieces, a decoder that drops the text's first space) with
    special tokens."""
    pieces = ["<unk>", "▁Hi", "▁there", "▁a", "b", "c", "▁The", "▁the", "re", "."]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoder
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("decoder", [
    decoders.Metaspace(replacement="▁", prepend_scheme="always"),
    decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]),
], ids=["metaspace", "llama2-strip"])
def test_runs_of_skipped_special_tokens_keep_the_next_words_space(decoder):
    """[▁Hi, </s> x4, ▁there] streams "Hi there", as transformers' decode; random sequences with runs of
    special tokens (skipped) stream what decode gives after the prompt's text."""
    tok = sentencepiece_tokenizer(decoder)
    hi, there, eos = tok.convert_tokens_to_ids(["▁Hi", "▁there", "</s>"])
    rng = random.Random(0)
    cases = [([], [hi, eos, eos, eos, eos, there])]
    for _ in range(300):
        ids: list[int] = []
        while len(ids) < 30:
            ids += [rng.choice([len(tok) - 3, len(tok) - 2, len(tok) - 1])] * rng.randint(1, 9) if rng.random() < 0.3 \
                else [rng.randrange(1, 10)]
        cases.append((ids[:rng.randint(0, 5)], ids[5:]))  # the prompt within the decoded prompt context
    for prompt, ids in cases:
        det = IncrementalDetokenizer(tok, prompt)
        streamed = "".join(det.add([t])[0] for t in ids) + det.flush()
        assert streamed == tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
