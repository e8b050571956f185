"""Parameters beyond the basics, each checked for its effect (not just acceptance)."""

from __future__ import annotations

import httpx

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_logit_bias_plus_100_forces_a_token(client, model_name, server, auth):
    tok = httpx.post(f"{server}/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                     headers=auth).json()["tokens"]
    assert len(tok) == 1
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=4,
                                       logit_bias={str(tok[0]): 100})
    assert r.choices[0].message.content == " banana" * 4


def test_min_tokens_and_ignore_eos(client, model_name):
    short = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=64)
    assert short.usage.completion_tokens < 30 and short.choices[0].finish_reason == "stop"
    longer = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=64,
                                            extra_body={"min_tokens": 40})
    assert longer.usage.completion_tokens >= 40
    forced = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=50,
                                            extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 50 and forced.choices[0].finish_reason == "length"


def test_chat_logprobs_shape_and_greedy_consistency(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content).startswith(r.choices[0].message.content[:5])
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob <= 0
        assert c.top_logprobs[0].token == c.token  # greedy picks the most likely token
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-4
        assert bytes(c.bytes).decode("utf-8", errors="replace")


def test_completion_echo_with_logprobs_includes_prompt(client, model_name):
    prompt = "The capital of France is"
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])


def test_stop_token_ids_and_no_stop_trim(client, model_name, server, auth):
    base = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24)
    text = base.choices[0].message.content
    ids = httpx.post(f"{server}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=auth).json()
    stop_id = ids["tokens"][2]
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                       extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    kept = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                          stop=["Paris"], extra_body={"no_stop_trim": True})
    assert kept.choices[0].message.content.endswith("Paris")


def test_penalties_change_greedy_output(client, model_name):
    msgs = [{"role": "user", "content": "Repeat the word cat many times."}]
    plain = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=30)
    penalised = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=30,
                                               frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_prefix_cache_reports_cached_tokens(client, model_name):
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 10}] + QUESTION
    client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=2)
    r = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64


def test_continue_final_message(client, model_name):
    msgs = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=4,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content
