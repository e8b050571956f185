"""guided_choice's grammar (rayllm.protocol.structured.choice_grammar) compiled by xgrammar with the real SmolLM2
tokenizer: each choice, written as the tokenizer (transformers) encodes it, is accepted token by token."""

from __future__ import annotations

import pytest

from rayllm.protocol.structured import choice_grammar, literal_choices
from rayllm.sample.guided import GrammarCompiler, new_matcher
from rayllm.schema.sampling_params import GuidedSpec


@pytest.fixture(scope="module")
def compiler(gguf_path):
    from rayllm.serve.chat_template import load_tokenizer

    tok = load_tokenizer(gguf_path)
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


@pytest.mark.parametrize("choices", [["😀 yes", "no"], ["𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "日本", "café"], ['a"b', "x\\y", "tab\there"]])
def test_every_choice_is_accepted_as_its_real_tokens(compiler, hf_tokenizer, choices):
    spec = GuidedSpec("ebnf", choice_grammar(choices), "guided_choice")
    assert literal_choices(spec) == choices  # the scoring path reads the same strings back
    grammar = compiler.compile(spec)
    for choice in choices:
        matcher = new_matcher(grammar)
        ids = hf_tokenizer.encode(choice, add_special_tokens=False)
        assert all(matcher.accept_token(t) for t in ids), choice
        assert matcher.accept_token(hf_tokenizer.eos_token_id) and matcher.is_terminated(), choice
