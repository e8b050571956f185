"""Literal-choice scoring (rayllm/serve/generation_modes.py) on the model replica's own LLMServer, driven
directly (no Ray Serve), in fp32 against transformers' logits on the same GGUF: a choice that another one
extends, and the empty choice, are scored with the end token after them, and scoring keeps the request's
tenant, priority and cache salt."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayllm.protocol.io_struct import GenerateRequest, StopOptions
from rayllm.protocol.structured import choice_grammar
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import GuidedSpec, SamplingParams
from rayllm.serve.llm_server import LLMServer

pytestmark = [pytest.mark.slow, pytest.mark.engine_only]


@pytest.fixture(scope="module")
def server(gguf_path):
    config = EngineConfig(model=ModelConfig(model=gguf_path, dtype="float32", max_model_len=512),
                          cache=CacheConfig(kv_cache_bytes=64 << 20),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                          parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1)))
    server = LLMServer(config, gguf_path, engine_process=False)
    yield server
    server.engine.shutdown()


def reference(hf_model, hf_tokenizer, prompt: list[int], choices: list[str]) -> list[float]:
    """transformers' logprob of each choice's canonical tokens, then of <|im_end|> (the model's EOS, what ends
    its chat turns) where another choice extends it: what the model ends with or goes on with there."""
    end = hf_tokenizer.eos_token_id
    canon = [hf_tokenizer.encode(c, add_special_tokens=False) for c in choices]
    out = []
    for ids in canon:
        extended = any(len(o) > len(ids) and o[: len(ids)] == ids for o in canon)
        seq = ids + [end] if extended else ids
        with torch.no_grad():
            lps = hf_model(torch.tensor([prompt + seq])).logits[0].float().log_softmax(-1)
        out.append(sum(lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(seq)))
    return out


def answer(server: LLMServer, prompt: list[int], guided: GuidedSpec, **params) -> str:
    req = GenerateRequest("t", [prompt], SamplingParams(temperature=0, max_tokens=8, **params), StopOptions(),
                          guided=guided)

    async def run() -> str:
        return "".join([d.text async for batch in server.generate(req) for d in batch])

    return asyncio.run(run())


def chat(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)


@pytest.mark.parametrize("question, choices, longer_wins", [
    # "1" is a token-prefix of "10": scored by its own tokens alone it always won
    ("What is 7 + 3? Answer with a number only.", ["1", "10"], True),
    ("How many legs does a spider have? Answer with a number only.", ["8", "80", "800"], False),
])
def test_a_choice_that_another_extends_is_scored_with_the_end(server, hf_model, hf_tokenizer, question, choices,
                                                              longer_wins):
    prompt = chat(hf_tokenizer, question)
    scores = reference(hf_model, hf_tokenizer, prompt, choices)
    best = max(range(len(choices)), key=scores.__getitem__)
    assert (best != 0) == longer_wins  # the reference's own pick, as the case is meant to check
    assert sorted(scores)[-1] - sorted(scores)[-2] > 1e-2
    assert answer(server, prompt, GuidedSpec("ebnf", choice_grammar(choices), "guided_choice")) == choices[best]


def test_an_empty_alternative_does_not_always_win(server, hf_model, hf_tokenizer):
    prompt = chat(hf_tokenizer, "Is water wet? Answer yes or no.")
    choices = ["yes", "no", ""]
    scores = reference(hf_model, hf_tokenizer, prompt, choices)
    best = max(range(len(choices)), key=scores.__getitem__)
    assert choices[best] != ""
    assert answer(server, prompt, GuidedSpec("regex", "yes|no|", "regex")) == choices[best]


def test_scoring_keeps_the_requests_tenant_priority_and_salt(server, hf_tokenizer, monkeypatch):
    """The scoring sequences are the request's own in the engine's tenant share and queue: the engine request
    scoring sends carries the tenant, priority and cache salt (recorded on the way to the real engine)."""
    sent: list[GenerateRequest] = []
    generate = server.generate

    def recording(req: GenerateRequest):
        sent.append(req)
        return generate(req)

    monkeypatch.setattr(server, "generate", recording)
    prompt = chat(hf_tokenizer, "Is water wet? Answer yes or no.")
    text = answer(server, prompt, GuidedSpec("ebnf", choice_grammar(["yes", "no"]), "guided_choice"),
                  tenant="owner-a", priority=-5, cache_salt="salt-a")
    assert text in ("yes", "no")
    scoring = sent[-1].params
    assert len(sent[-1].prompts) == 2 and scoring.prompt_logprobs == 0 and scoring.max_tokens == 1
    assert (scoring.tenant, scoring.priority, scoring.cache_salt) == ("owner-a", -5, "salt-a")


def test_a_logit_bias_is_applied_under_the_grammar(server, hf_model, hf_tokenizer):
    """Scoring reads raw logprobs: with a logit_bias the choice is sampled under its grammar, which applies it."""
    prompt = chat(hf_tokenizer, "Is water wet? Answer yes or no.")
    choices = ["yes", "no"]
    scores = reference(hf_model, hf_tokenizer, prompt, choices)
    worse = min(range(2), key=scores.__getitem__)
    (token,) = hf_tokenizer.encode(choices[worse], add_special_tokens=False)
    guided = GuidedSpec("ebnf", choice_grammar(choices), "guided_choice")
    assert answer(server, prompt, guided) == choices[1 - worse]
    assert answer(server, prompt, guided, logit_bias=((token, 50.0),)) == choices[worse]
