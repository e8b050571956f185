"""The snapshot tokenizer (rayllm.serve.rust_tokenizer) against transformers' own tokenizer of the same model:
token-for-token encodes, decodes, vocabulary, special ids and rendered chat templates, on the real SmolLM2
tokenizer (from its GGUF) and on a SentencePiece-style (byte-fallback) tokenizer built here."""

from __future__ import annotations

import json
import os
import random

import pytest

from rayllm.serve.chat_template import ChatRenderer, _snapshot_dir, load_serving_tokenizer, load_tokenizer
from rayllm.serve.rust_tokenizer import (
    SNAPSHOT_FILE,
    RustTokenizer,
    load_snapshot,
    save_snapshot,
    snapshottable,
)
from rayllm.serve.tokenizer import TokenizerService

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|im_", "im_end|>"]
PIECES = ["Hello", " world", "wörld", "naïve café", "東京タワー", "Привет", "مرحبا", "नमस्ते", "🎉", "👩‍💻", "🇫🇷",
          "x² ≤ ∞", "“quotes”", "\t", "\n", "\n\n", "  ", "   ", "\r\n", "\x00", "\ufffd", "e\u0301", "def f(a):\n    return a",
          "1234567", "3.14159", "http://example.com/a?b=c", "<>&\"'", "ﬁ", "Ａ", "\u200b", "`code`", "ÿ"]


def corpus(n: int, seed: int = 0) -> list[str]:
    """Fixed and random strings: mixed scripts, emoji, whitespace runs, control characters, special tokens
    (whole and cut), random code points."""
    rng = random.Random(seed)
    out = ["", " ", "a", " a", "a ", "  leading", "trailing  ", "".join(PIECES)]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.55:
                parts.append(rng.choice(PIECES))
            elif kind < 0.7:
                parts.append(rng.choice(SPECIALS))
            else:
                parts.append("".join(chr(rng.choice([rng.randint(32, 0x24F), rng.randint(0x370, 0x10FF),
                                                     rng.randint(0x3000, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
                                     for _ in range(rng.randint(1, 6))))
            if rng.random() < 0.3:
                parts.append(rng.choice([" ", "  ", "\n", ""]))
        out.append("".join(parts))
    return out


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "東京タワー 🎉 <|im_end|> inside content"}],
    [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
         "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    [{"role": "user", "content": "Think"}, {"role": "assistant", "content": "42", "reasoning_content": "because"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# Uses what transformers passes a template: the special tokens' strings, kwargs, tools, raise_exception.
CUSTOM = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('system first') }}{% endif %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
          "{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}{% if flag %}!{{ flag }}{% endif %}"
          "{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}")


def assert_same(rust: RustTokenizer, ref, texts: list[str], seed: int = 0) -> None:
    """Every call serving makes answers as transformers' tokenizer `ref` does."""
    assert isinstance(rust, RustTokenizer) and not isinstance(ref, RustTokenizer)
    assert rust.get_vocab() == ref.get_vocab() and len(rust) == len(ref)
    assert {i: (t.content, t.special) for i, t in rust.added_tokens_decoder.items()} == \
        {i: (t.content, t.special) for i, t in ref.added_tokens_decoder.items()}
    assert (rust.eos_token_id, rust.bos_token_id, rust.special_tokens_map, rust.chat_template) == \
        (ref.eos_token_id, ref.bos_token_id, ref.special_tokens_map, ref.chat_template)
    assert rust.convert_tokens_to_ids(SPECIALS + ["Hello", "no-such-token"]) == \
        ref.convert_tokens_to_ids(SPECIALS + ["Hello", "no-such-token"])
    for text in texts:
        for special in (False, True):
            ids = rust.encode(text, add_special_tokens=special)
            assert ids == ref.encode(text, add_special_tokens=special), text
            assert rust.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
            for skip in (False, True):
                assert rust.decode(ids, skip_special_tokens=skip) == \
                    ref.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), text
    rng = random.Random(seed)
    for _ in range(200):  # any ids, split UTF-8 characters and special tokens included
        ids = [rng.randrange(len(ref)) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert rust.decode(ids, skip_special_tokens=skip) == \
                ref.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert rust.convert_ids_to_tokens(ids, skip_special_tokens=True) == \
            ref.convert_ids_to_tokens(ids, skip_special_tokens=True)


def assert_same_renders(rust: RustTokenizer, ref) -> None:
    """ChatRenderer (what the tokenizer replica runs) on both: same text, or the same client error."""
    ours, theirs = ChatRenderer(rust), ChatRenderer(ref)
    calls = [dict(), dict(add_generation_prompt=False), dict(tools=TOOLS), dict(chat_template=CUSTOM),
             dict(chat_template=CUSTOM, tools=TOOLS, chat_template_kwargs={"flag": "on", "bos_token": "B"})]
    for messages in CONVERSATIONS:
        for kw in calls:
            results = []
            for renderer in (ours, theirs):
                try:
                    results.append(renderer.render(messages, **kw))
                except ValueError as exc:
                    results.append(("error", str(exc)))
            assert results[0] == results[1], (messages, kw)
    final = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": "Paris is"}]
    kw = dict(add_generation_prompt=False, continue_final_message=True)
    assert ours.render(final, **kw) == theirs.render(final, **kw)
    system_late = [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
    for renderer in (ours, theirs):
        with pytest.raises(ValueError, match="system first"):
            renderer.render(system_late, chat_template=CUSTOM)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENIZER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_tokenizer_snapshot_equals_transformers(gguf_path, hf_tokenizer, cache, monkeypatch):
    first = load_serving_tokenizer(gguf_path)  # no snapshot yet: transformers loads, the snapshot is saved
    assert not isinstance(first, RustTokenizer)
    assert os.path.isfile(os.path.join(_snapshot_dir(gguf_path), SNAPSHOT_FILE))
    rust = load_serving_tokenizer(gguf_path)
    texts = corpus(300)
    assert_same(rust, first, texts)
    assert_same(rust, hf_tokenizer, texts[:60])  # transformers' rebuild straight from the GGUF, too
    assert_same_renders(rust, first)
    service = TokenizerService(gguf_path)
    assert isinstance(service.tokenizer, RustTokenizer)
    assert service.transformers_tokenizer().get_vocab() == rust.get_vocab()  # xgrammar's: transformers' own
    monkeypatch.setattr("rayllm.serve.tokenizer.load_serving_tokenizer", lambda _: first)
    reference = TokenizerService(gguf_path)  # the service as it ran on transformers' tokenizer
    ids = list(range(0, len(rust), 37))
    assert service.token_bytes(ids) == reference.token_bytes(ids)
    assert service.token_strings(ids) == reference.token_strings(ids)
    assert (service.info(), service.eos_token_ids, service.vocab_size) == \
        (reference.info(), reference.eos_token_ids, reference.vocab_size)


def sentencepiece_style(directory) -> str:
    """A Llama-2-style tokenizer built here: BPE over '▁'-joined words with byte fallback, <s> added by the
    post-processor, and a template that raises on bad role order; saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{b:02X}>" for b in range(256)])
    backend.train_from_iterator(corpus(200, seed=1), trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    template = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                "{% if m.role == 'user' %}{{ bos_token }}[INST] {{ m.content | trim }} [/INST]"
                "{% else %} {{ m.content | trim }} {{ eos_token }}{% endif %}{% endfor %}")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  chat_template=template)
    tok.save_pretrained(str(directory))
    return str(directory)


def test_sentencepiece_style_directory(tmp_path, cache):
    path = sentencepiece_style(tmp_path / "model")
    ref = load_tokenizer(path)
    assert snapshottable(ref)
    assert not isinstance(load_serving_tokenizer(path), RustTokenizer)
    rust = load_serving_tokenizer(path)
    assert_same(rust, ref, corpus(150, seed=2), seed=2)
    ours, theirs = ChatRenderer(rust), ChatRenderer(ref)
    chat = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Grüße 🎉"}]
    assert ours.render(chat) == theirs.render(chat)
    for renderer in (ours, theirs):
        with pytest.raises(ValueError, match="alternate"):
            renderer.render(chat[1:])
    # A changed tokenizer file is another snapshot: the new one is loaded through transformers first.
    config = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    (tmp_path / "model" / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<unk>"}))
    changed = load_serving_tokenizer(path)
    assert not isinstance(changed, RustTokenizer) and changed.eos_token_id == 0
    assert load_serving_tokenizer(path).eos_token_id == 0


def test_no_snapshot_for_other_versions_or_overriding_classes(gguf_path, cache):
    ref = load_serving_tokenizer(gguf_path)
    directory = _snapshot_dir(gguf_path)
    path = os.path.join(directory, SNAPSHOT_FILE)
    data = json.loads(open(path).read())
    assert load_snapshot(directory) is not None
    data["versions"]["tokenizers"] = "0.0.1"  # made by another tokenizers: not read
    with open(path, "w") as f:
        json.dump(data, f)
    assert load_snapshot(directory) is None
    assert not isinstance(load_serving_tokenizer(gguf_path), RustTokenizer)  # rewritten now
    assert isinstance(load_serving_tokenizer(gguf_path), RustTokenizer)

    class Custom(type(ref)):  # a tokenizer class of its own decoding: served by transformers, always
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    ref.__class__ = Custom
    assert not snapshottable(ref) and not save_snapshot(ref, str(cache))
