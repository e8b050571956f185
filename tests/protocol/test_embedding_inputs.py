"""rayllm.protocol.embeddings' bounds on tokenized inputs (the serve path: tests/serve/test_embeddings.py)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from rayllm.protocol.embeddings import EmbeddingRequest, check_tokens, raw_inputs
from rayllm.protocol.errors import APIError


def stripping_tokenizer() -> Tokenizer:
    """A real `tokenizers` tokenizer whose normalizer strips whitespace: a blank text encodes to no tokens."""
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.normalizer = normalizers.Strip()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_an_input_that_encodes_to_no_tokens_is_a_400_naming_it():
    tok = stripping_tokenizer()
    items = raw_inputs(EmbeddingRequest(input=["hello world", "   "]), 0)  # both non-empty texts: accepted
    prompts = [enc.ids for enc in tok.encode_batch(items)]
    assert prompts == [[0, 1], []]
    with pytest.raises(APIError) as exc:  # was max() of an empty list: a 500
        check_tokens(prompts, per_input=16, vocab_size=tok.get_vocab_size())
    assert (exc.value.status_code, exc.value.param, exc.value.message) == (400, "input", "input[1] encodes to no tokens")
    assert check_tokens(prompts[:1], per_input=16, vocab_size=tok.get_vocab_size()) == 2
