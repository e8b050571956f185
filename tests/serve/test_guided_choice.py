"""Canonical guided choices through the server: `guided_choice` (and a regex that is a plain alternation of
literals) answers with one choice spelled in its canonical tokens, picked by the model's log-probability of
those tokens after the prompt, checked against transformers' fp32 model on the same GGUF (served in fp32 for
those checks: conftest.fp32_client)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

PROMPT = "Question: Is the sky blue on a clear day? Answer with one word.\nAnswer:"
CHOICES = [" affirmative", " negative", " perhaps", " unknowable"]


def reference_scores(hf_model, hf_tokenizer, prompt_ids: list[int], choices: list[str]) -> list[list[float]]:
    """Per choice: the reference model's logprob of each of its canonical tokens, given the prompt."""
    import torch

    out = []
    for c in choices:
        ids = hf_tokenizer.encode(c, add_special_tokens=False)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt_ids + ids])).logits[0].float()
        lps = logits.log_softmax(-1)
        out.append([lps[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(ids)])
    return out


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT)
    per_token = reference_scores(hf_model, hf_tokenizer, prompt_ids, CHOICES)
    return prompt_ids, per_token, [sum(t) for t in per_token]


def canonical_len(hf_tokenizer, text: str) -> int:
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def complete(client, model_name: str, **kw):
    return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=16, **kw)


def test_greedy_choice_is_the_argmax_of_the_reference_scores_with_its_logprobs(fp32_client, model_name, reference,
                                                                                 hf_tokenizer):
    prompt_ids, per_token, scores = reference
    r = complete(fp32_client, model_name, temperature=0, logprobs=2, extra_body={"guided_choice": CHOICES})
    c = r.choices[0]
    best = max(range(len(CHOICES)), key=scores.__getitem__)
    ranked = sorted(scores, reverse=True)
    assert ranked[0] - ranked[1] > 1e-3, "the reference must separate the choices for the check to mean anything"
    assert c.text == CHOICES[best]
    assert c.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == canonical_len(hf_tokenizer, CHOICES[best])
    # The logprobs are those of the canonical tokens, equal to the reference's log-softmax.
    assert c.logprobs.tokens == [hf_tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in
                                 hf_tokenizer.encode(CHOICES[best], add_special_tokens=False)]
    assert c.logprobs.token_logprobs == pytest.approx(per_token[best], abs=2e-3)
    # The two most likely tokens and, as OpenAI and vLLM, the chosen one.
    assert all(tok in t and 2 <= len(t) <= 3 for tok, t in zip(c.logprobs.tokens, c.logprobs.top_logprobs, strict=True))


def test_a_regex_of_literal_alternatives_is_chosen_the_same_way(fp32_client, model_name, reference):
    _, _, scores = reference
    pattern = "(?:" + "|".join(CHOICES) + ")"
    r = complete(fp32_client, model_name, temperature=0, extra_body={"regex": pattern})
    assert r.choices[0].text == CHOICES[max(range(len(CHOICES)), key=scores.__getitem__)]


def test_sampled_choices_are_canonical_and_reproducible_with_a_seed(client, model_name, reference, hf_tokenizer):
    """The issue's case: at temperature > 0 every answer is a whole choice in its canonical tokens. The twelve
    seeds are asked at once, twice (a seeded draw does not depend on the batch it runs in)."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(seed: int):
        return complete(client, model_name, temperature=2.0, seed=seed, n=2, extra_body={"guided_choice": CHOICES})

    seeds = range(12)
    with ThreadPoolExecutor(len(seeds)) as pool:
        first, second = list(pool.map(ask, seeds)), list(pool.map(ask, seeds))
    answers = {}
    for seed, r, again in zip(seeds, first, second, strict=True):
        assert [c.text for c in r.choices] == [c.text for c in again.choices]
        for c in r.choices:
            assert c.text in CHOICES and c.finish_reason == "stop"
        assert r.usage.completion_tokens == sum(canonical_len(hf_tokenizer, c.text) for c in r.choices)
        answers[seed] = r.choices[0].text
    # At a high temperature the draws follow the scores, not the argmax alone (fixed seeds: deterministic).
    assert len(set(answers.values())) > 1


def test_chat_choice_streams_the_canonical_choice(client, model_name, hf_tokenizer):
    messages = [{"role": "user", "content": "Is water wet? Answer yes or no."}]
    kw = {"model": model_name, "messages": messages, "temperature": 0.7, "seed": 5,
          "extra_body": {"guided_choice": ["yes", "no"]}}
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    assert text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == canonical_len(hf_tokenizer, text)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["stop"]


def test_a_choice_longer_than_max_tokens_is_cut_with_length(client, model_name, hf_tokenizer):
    long = " a very long answer that takes many tokens"
    assert canonical_len(hf_tokenizer, long) > 3
    r = complete(client, model_name, temperature=0, extra_body={"guided_choice": [long]})
    assert r.choices[0].text == long and r.choices[0].finish_reason == "stop"
    cut = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"guided_choice": [long]})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3
    assert long.startswith(cut.choices[0].text) and cut.choices[0].text != long


@pytest.mark.parametrize("guided", [None, {"guided_choice": CHOICES}], ids=["free", "choice"])
def test_an_empty_prompt_is_a_400_naming_prompt(client, model_name, hf_tokenizer, guided):
    """SmolLM2 has no BOS, so "" encodes to no tokens: nothing to continue or to score a choice after (the
    fuzz found this answered 500 with guided_choice)."""
    import openai

    assert hf_tokenizer.encode("") == []
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="", max_tokens=2, extra_body=guided)
    assert e.value.body["param"] == "prompt"


def test_choices_past_the_scoring_budget_are_sampled_under_the_grammar(client, model_name, hf_tokenizer, llm_stats):
    """Scoring prefills the prompt once a literal (prompt logprobs skip the prefix cache): 70 choices after a
    ~1,000-token prompt (~70,000 tokens, past generation_modes.MAX_SCORING_TOKENS) are sampled under the
    choice grammar instead, in a handful of steps, and the answer is still one of the choices."""
    from rayllm.serve.generation_modes import MAX_SCORING_TOKENS

    prompt = "The list goes on. " * 200 + "Pick one option:"
    choices = [f" option {i}" for i in range(70)]
    assert len(choices) * len(hf_tokenizer.encode(prompt)) > MAX_SCORING_TOKENS
    steps = llm_stats()["num_steps"]
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    # Scoring would take >= 70,000 / 512 prefill steps (the app's step budget); the grammar path a few.
    assert llm_stats()["num_steps"] - steps < 40


def test_a_choice_whose_last_prefill_chunk_is_one_token_is_scored(client, model_name, hf_model, hf_tokenizer):
    """The shared app prefills 512 tokens a step: a 512-token prompt plus a one-token choice leaves that choice's
    last chunk a single token, which predicts no prompt token yet must still return the choice's logprob (once
    lost, the choice scored 0, the best score, and was picked whatever the model thought of it)."""
    text = "The capital of France is Paris. " * 80 + "The capital of France is"
    prompt = hf_tokenizer.encode(text)[-512:]
    choices = [" zebra", " Paris"]  # the unlikely one first: it is the one whose last chunk is one token
    assert all(canonical_len(hf_tokenizer, c) == 1 for c in choices)
    import torch

    with torch.no_grad():
        lps = hf_model(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    scores = [lps[hf_tokenizer.encode(c, add_special_tokens=False)[0]].item() for c in choices]
    assert scores[1] - scores[0] > 5  # far apart: bf16 serving cannot reorder them
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                  extra_body={"guided_choice": choices})
    c = r.choices[0]
    assert c.text == " Paris" and c.finish_reason == "stop"
    assert c.logprobs.token_logprobs == pytest.approx([scores[1]], abs=0.5)  # bf16 serving (BF16_TOL)
