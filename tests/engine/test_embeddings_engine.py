"""Pooling requests in the engine (SamplingParams.embed), against transformers' final-norm hidden states:
last and mean pooling, chunked prefill, batching beside generation, freed blocks.

The engine runs `tiny_llama` (RANDOM weights, the default model's vocabulary and end ids) and the reference
is transformers on the same checkpoint (`tiny_hf_model`): pooling and batching are the engine's, whatever
the weights say."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.schema.sampling_params import SamplingParams
from tests.engine.test_engine import GREEDY, make_engine

pytestmark = pytest.mark.slow  # engines and transformers: `make test-fast` skips it

EMBED = SamplingParams(embed=True)


def reference(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden state (after the final norm: checked below against lm_head), pooled, unit length."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0]
    torch.testing.assert_close(hf_model.lm_head(h), out.logits[0], rtol=1e-4, atol=1e-4)  # i.e. post-norm
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / v.norm()


def embed_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[float]]:
    ids = [f"emb-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, EMBED)
    got: dict[str, list[float]] = {}
    while engine.has_work():
        for out in engine.step():
            assert not out.new_token_ids and out.error is None
            if out.finished:
                got[out.request_id] = out.embedding
    return [got[r] for r in ids]


@pytest.fixture(scope="module")
def engine(tiny_llama, eos) -> LLMEngine:
    eng = make_engine(tiny_llama, eos)
    yield eng
    eng.shutdown()


def test_last_token_pooling_equals_transformers_and_frees_blocks(engine, tiny_hf_model, hf_tokenizer):
    texts = ["The cat sat on the mat.", "A long document about rivers. " * 12]  # the second: several chunks
    prompts = [hf_tokenizer(t).input_ids for t in texts]
    assert len(prompts[1]) > engine.config.scheduler.max_num_batched_tokens
    for got, ids in zip(embed_all(engine, prompts), prompts, strict=True):
        assert got is not None and len(got) == tiny_hf_model.config.hidden_size
        torch.testing.assert_close(torch.tensor(got), reference(tiny_hf_model, ids, "last"), rtol=1e-4, atol=1e-4)
    assert engine.stats().kv_usage == 0.0 and not engine.seqs


def test_last_pooling_over_a_cached_prefix_is_unchanged(engine, hf_tokenizer):
    ids = hf_tokenizer("Shared context that is long enough to fill whole cache blocks. " * 4).input_ids
    first = embed_all(engine, [ids])[0]
    second = embed_all(engine, [ids])[0]  # its full blocks now come from the prefix cache
    torch.testing.assert_close(torch.tensor(second), torch.tensor(first), rtol=1e-5, atol=1e-5)


def test_pooling_beside_generation_leaves_greedy_outputs_unchanged(engine, chat_prompts, hf_tokenizer):
    alone = engine.generate(chat_prompts, GREEDY)
    emb_ids = hf_tokenizer("An embedding request in the same steps. " * 8).input_ids
    expected = embed_all(engine, [emb_ids])[0]
    gen_ids = [f"gen-{i}" for i in range(len(chat_prompts))]
    for rid, p in zip(gen_ids, chat_prompts, strict=True):
        engine.add_request(rid, p, GREEDY)
    tokens: dict[str, list[int]] = {r: [] for r in gen_ids}
    for out in engine.step():  # the generating requests are running when the pooling one arrives
        tokens[out.request_id].extend(out.new_token_ids)
    # Another salt: the expected run's blocks are not reused, so this one is prefilled in chunks.
    engine.add_request("emb", emb_ids, SamplingParams(embed=True, cache_salt="fresh"))
    embedding = None
    mixed = False
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "emb":
                embedding = out.embedding if out.finished else embedding
            else:
                tokens[out.request_id].extend(out.new_token_ids)
        running = {s.request_id for s in engine.scheduler.running}  # emb part-prefilled beside generation
        mixed |= "emb" in running and bool(running & set(gen_ids))
    assert mixed
    assert [tokens[r] for r in gen_ids] == alone
    torch.testing.assert_close(torch.tensor(embedding), torch.tensor(expected), rtol=1e-4, atol=1e-4)
    assert engine.stats().kv_usage == 0.0 and not engine.seqs


def test_mean_pooling_equals_transformers(engine, tiny_hf_model, hf_tokenizer):
    # model.pooling is read when a pooling request is added (nothing the worker holds): this is the engine
    # a `pooling: mean` config builds; the module's engine goes back to last-token pooling after.
    eng, config = engine, engine.config
    eng.config = dataclasses.replace(config, model=dataclasses.replace(config.model, pooling="mean"))
    eng.reset_prefix_cache()
    try:
        ids = hf_tokenizer("Mean pooling over every token of a prompt in several chunks. " * 8).input_ids
        embed_all(eng, [ids])  # fills the prefix cache: mean pooling must not reuse it
        got = embed_all(eng, [ids])[0]
        torch.testing.assert_close(torch.tensor(got), reference(tiny_hf_model, ids, "mean"), rtol=1e-4, atol=1e-4)
        assert eng.stats().kv_usage == 0.0
    finally:
        eng.config = config
