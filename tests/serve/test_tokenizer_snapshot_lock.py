"""rayllm.serve.chat_template.load_serving_tokenizer when several processes miss a new model's tokenizer snapshot
at once (an app's tokenizer and model replicas start together): one builds it through transformers while the
others wait on its lock and then read the snapshot; a lock held too long, the waiter builds it itself."""

from __future__ import annotations

import json
import os
import threading

import pytest

from rayllm.serve import chat_template
from rayllm.serve.rust_tokenizer import RustTokenizer, save_snapshot


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A Hugging Face directory with a small word-level fast tokenizer; the snapshot cache is this test's."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("TOKENIZER_CACHE", str(tmp_path / "cache"))
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "model"
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "[UNK]",
         "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return str(path)


def test_a_process_that_finds_the_snapshot_being_built_waits_and_reads_it(model_dir, monkeypatch):
    directory = chat_template._snapshot_dir(model_dir)
    built = chat_template.load_tokenizer(model_dir)  # what the lock's holder builds
    missed = threading.Event()
    real_load_snapshot = chat_template.load_snapshot

    def load_snapshot(d):
        tok = real_load_snapshot(d)
        missed.set()
        return tok

    def load_tokenizer(path):
        raise AssertionError("the waiting process built the tokenizer itself")

    monkeypatch.setattr(chat_template, "load_snapshot", load_snapshot)
    monkeypatch.setattr(chat_template, "load_tokenizer", load_tokenizer)
    result = {}
    with chat_template._snapshot_lock(directory):
        waiter = threading.Thread(target=lambda: result.update(tok=chat_template.load_serving_tokenizer(model_dir)))
        waiter.start()
        assert missed.wait(60)  # it found no snapshot: it goes for the lock, which is held here
        os.makedirs(directory, exist_ok=True)
        assert save_snapshot(built, directory)
    waiter.join(60)
    tok = result["tok"]
    assert isinstance(tok, RustTokenizer)
    assert tok.encode("hello world", add_special_tokens=False) == built.encode("hello world", add_special_tokens=False)


def test_a_lock_held_too_long_is_passed_by(model_dir, monkeypatch):
    monkeypatch.setattr(chat_template, "SNAPSHOT_LOCK_TIMEOUT_S", 0.2)
    directory = chat_template._snapshot_dir(model_dir)
    with chat_template._snapshot_lock(directory):  # held (by a process that hangs) for the whole load
        tok = chat_template.load_serving_tokenizer(model_dir)
    assert not isinstance(tok, RustTokenizer)  # built through transformers here
    assert isinstance(chat_template.load_serving_tokenizer(model_dir), RustTokenizer)  # and its snapshot saved
