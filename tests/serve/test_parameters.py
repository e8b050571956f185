"""Parameters beyond the basics, each checked for its effect (not just acceptance)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def concurrently(*calls):
    """The calls' results in order, sent at once (the first exception raised is raised): batched for a fraction
    of their cost one by one, and each answer is the one it would be alone (batch-invariant; seeded draws too)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def _stream_text(stream) -> str:  # a chat stream's text
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    """One client for the module's plain HTTP requests: each new one builds an SSL context (~20 ms of CPU)."""
    with httpx.Client(timeout=60) as client:
        yield client


def test_logit_bias_plus_100_forces_a_token(client, model_name, server, auth):
    tok = httpx.post(f"{server}/tokenize", json={"prompt": " banana", "add_special_tokens": False},
                     headers=auth).json()["tokens"]
    assert len(tok) == 1
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=4,
                                       logit_bias={str(tok[0]): 100})
    assert r.choices[0].message.content == " banana" * 4


def test_min_tokens_and_ignore_eos(client, model_name):
    short, longer = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=64),
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=64,
                                               extra_body={"min_tokens": 40}))
    assert short.usage.completion_tokens < 30 and short.choices[0].finish_reason == "stop"
    assert longer.usage.completion_tokens >= 40
    # Twice the tokens at which the same request stopped by itself: ignore_eos goes on past that EOS.
    n = 2 * short.usage.completion_tokens
    forced = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=n,
                                            extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == n and forced.choices[0].finish_reason == "length"


def test_min_tokens_holds_stop_strings_back(client, model_name):
    """As vLLM: a stop string counts only once it ends after the first min_tokens tokens' text; the same
    request without `stop` (greedy, same min_tokens, its tokens from logprobs) is the reference."""
    kw = dict(model=model_name, messages=QUESTION, temperature=0, max_tokens=64, extra_body={"min_tokens": 20})
    ref, r, streamed = concurrently(
        lambda: client.chat.completions.create(logprobs=True, **kw),
        lambda: client.chat.completions.create(stop=["."], **kw),
        lambda: _stream_text(client.chat.completions.create(stop=["."], stream=True, **kw)))
    full = ref.choices[0].message.content
    boundary = len("".join(t.token for t in ref.choices[0].logprobs.content[:20]))
    assert 0 <= full.find(".") < boundary  # without min_tokens, the first "." would end it
    cut = full.find(".", boundary)
    assert r.choices[0].message.content == (full[:cut] if cut >= 0 else full)
    assert r.choices[0].finish_reason == ("stop" if cut >= 0 else ref.choices[0].finish_reason)
    assert streamed == r.choices[0].message.content


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
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # the two most likely, and the chosen token


@pytest.mark.parametrize("logprobs", [0, 2])
def test_completion_top_logprobs_always_hold_the_chosen_token(client, model_name, logprobs):
    """As OpenAI and vLLM: each position's top_logprobs holds the token chosen (echoed prompt tokens too), with
    its own logprob; `logprobs: 0` gives that token alone."""
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=4, temperature=0.8,
                                  seed=5, echo=True, logprobs=logprobs)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None  # the first prompt token has no logprob
    rest = list(zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True))
    assert len(rest) > 4
    for token, value, top in rest:
        assert top[token] == value and len(top) <= logprobs + 1
        if logprobs == 0:
            assert top == {token: value}


def test_stop_token_ids_and_no_stop_trim(client, model_name, server, auth):
    base, kept = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24),
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                               stop=["Paris"], extra_body={"no_stop_trim": True}))
    text = base.choices[0].message.content
    ids = httpx.post(f"{server}/tokenize", json={"prompt": text, "add_special_tokens": False}, headers=auth).json()
    stop_id = ids["tokens"][2]
    r = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24,
                                       extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
    assert kept.choices[0].message.content.endswith("Paris")


def test_penalties_change_greedy_output(client, model_name):
    msgs = [{"role": "user", "content": "Repeat the word cat many times."}]
    kw = dict(model=model_name, messages=msgs, temperature=0, max_tokens=12)
    plain, penalised = concurrently(lambda: client.chat.completions.create(**kw), lambda: client.chat.completions.create(
        frequency_penalty=2.0, extra_body={"repetition_penalty": 1.5}, **kw))
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_prefix_cache_reports_cached_tokens(client, model_name):
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 10}] + QUESTION
    client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=2)
    r = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens >= 64


def test_cached_tokens_are_one_figure_per_prompt_whatever_the_choices(client, model_name):
    """With n=2 the second choice finds the whole prompt that the first computed: usage reports the prompt's
    cache hits as a lone request on a fresh prompt of the same shape does (only the shared template prefix)."""
    def fresh(lead: str) -> list[dict]:  # a distinct first token: only the template's prefix is in the cache
        return [{"role": "user", "content": f"{lead} {uuid.uuid4().hex} " + "Tell me about the sea. " * 8}]

    kw = dict(model=model_name, temperature=0, max_tokens=2)
    client.chat.completions.create(messages=fresh("Warm"), **kw)  # the template's prefix, cached for both below
    alone = client.chat.completions.create(messages=fresh("Alpha"), **kw).usage
    both = client.chat.completions.create(messages=fresh("Omega"), n=2, **kw).usage
    assert both.prompt_tokens_details.cached_tokens == alone.prompt_tokens_details.cached_tokens
    assert both.prompt_tokens_details.cached_tokens < both.prompt_tokens - 32


def test_continue_final_message(client, model_name):
    msgs = QUESTION + [{"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=model_name, messages=msgs, temperature=0, max_tokens=4,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content


def test_return_hidden_states_match_transformers(fp32_client, client, model_name, fp32_server, auth, hf_model,
                                                hf_tokenizer):
    import torch

    prompt = "The capital of France is"
    r = fp32_client.completions.create(model=model_name, prompt=prompt, temperature=0, max_tokens=5,
                                  extra_body={"return_hidden_states": True})
    hidden = r.choices[0].model_extra["hidden_states"]
    assert len(hidden) == r.usage.completion_tokens == 5 and len(hidden[0]) == hf_model.config.hidden_size
    prompt_ids = httpx.post(f"{fp32_server}/tokenize", json={"prompt": prompt}, headers=auth).json()["tokens"]
    with torch.no_grad():
        full = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=5, do_sample=False)[0]
        assert hf_tokenizer.decode(full[len(prompt_ids):]) == r.choices[0].text  # same greedy tokens
        ref = hf_model(full[None, :-1], output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    # Row k is the state that predicted output token k: the last prompt token, then each output token.
    assert torch.allclose(torch.tensor(hidden), ref[len(prompt_ids) - 1:], atol=2e-3, rtol=1e-3)
    chat, plain = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=3,
                                               extra_body={"return_hidden_states": True}),
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=3))
    assert len(chat.choices[0].model_extra["hidden_states"]) == 3
    assert "hidden_states" not in (plain.choices[0].model_extra or {})


def test_best_of_returns_the_most_likely_candidates(client, model_name, server, auth):
    kw = dict(model=model_name, prompt="Once upon a time", temperature=1.0, max_tokens=8, seed=123)
    every, best = concurrently(lambda: client.completions.create(n=4, logprobs=0, **kw),
                               lambda: client.completions.create(n=2, best_of=4, **kw))
    score = {c.index: sum(c.logprobs.token_logprobs) for c in every.choices}
    ranked = sorted(score, key=score.get, reverse=True)
    texts = {c.index: c.text for c in every.choices}
    assert len(set(texts.values())) > 1  # the candidates differ, so picking matters
    assert [c.text for c in best.choices] == [texts[ranked[0]], texts[ranked[1]]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # usage counts all candidates
    r = httpx.post(f"{server}/v1/completions", headers=auth, json={
        "model": model_name, "prompt": "x", "best_of": 3, "stream": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_suffix_needs_fill_in_the_middle_tokens(server, auth, model_name):
    r = httpx.post(f"{server}/v1/completions", headers=auth, json={
        "model": model_name, "prompt": "def add(a, b):", "suffix": "\n", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in r.json()["error"]["message"]


def test_special_tokens_in_output(client, model_name, hf_tokenizer):
    # +100 on <|im_end|> (id 2) with ignore_eos: the output is that special token three times.
    kw = dict(model=model_name, prompt="Hi", max_tokens=3, temperature=0, logit_bias={"2": 100})
    skipped, *kept = concurrently(lambda: client.completions.create(extra_body={"ignore_eos": True}, **kw), *(
        lambda s=s: client.completions.create(extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                          "spaces_between_special_tokens": s}, **kw) for s in (False, True)))
    assert skipped.choices[0].text == "" and skipped.usage.completion_tokens == 3
    # Kept as transformers' fast decode (and vLLM) writes them: spaces_between_special_tokens is accepted but,
    # as there, has no effect on a fast tokenizer.
    ref = hf_tokenizer.decode([2, 2, 2], skip_special_tokens=False)
    assert ref == "<|im_end|>" * 3
    for one in kept:  # spaces_between_special_tokens False, then True
        assert one.choices[0].text == ref


def test_chat_template_override(client, model_name, server, auth):
    content = "Just these words."
    r = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": content}],
                                       max_tokens=2, extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    n = len(httpx.post(f"{server}/tokenize", json={"prompt": content, "add_special_tokens": False},
                       headers=auth).json()["tokens"])
    assert r.usage.prompt_tokens == n  # the override rendered the bare content, no ChatML around it


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client, model_name, hf_tokenizer):
    """vLLM's truncate_prompt_tokens on completions, chat and embeddings: the answer equals the same request
    sent with only the prompt's last k token ids (transformers' tokenizer and chat template on the same GGUF)."""
    k = 12
    text = "Here is a list of fruit: apple, pear, plum, cherry, grape, lemon, lime, melon, and then the colour of the sky is"
    ids = hf_tokenizer(text).input_ids
    assert len(ids) > 2 * k
    messages = [{"role": "user", "content": text}]
    rendered = hf_tokenizer(hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False).input_ids
    cut, ref, chat, chat_ref, emb, emb_ref = concurrently(
        lambda: client.completions.create(model=model_name, prompt=text, max_tokens=6, temperature=0, echo=True,
                                          extra_body={"truncate_prompt_tokens": k}),
        lambda: client.completions.create(model=model_name, prompt=ids[-k:], max_tokens=6, temperature=0),
        lambda: client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0,
                                               extra_body={"truncate_prompt_tokens": k}),
        lambda: client.completions.create(model=model_name, prompt=rendered[-k:], max_tokens=6, temperature=0),
        lambda: client.embeddings.create(model=model_name, input=[text], extra_body={"truncate_prompt_tokens": k}),
        lambda: client.embeddings.create(model=model_name, input=[ids[-k:]]))
    assert cut.usage.prompt_tokens == k
    assert cut.choices[0].text == hf_tokenizer.decode(ids[-k:]) + ref.choices[0].text  # echo: what the model saw
    assert chat.usage.prompt_tokens == k and chat.choices[0].message.content == chat_ref.choices[0].text
    assert emb.usage.prompt_tokens == k and emb.data[0].embedding == emb_ref.data[0].embedding


@pytest.mark.parametrize("keep", [0, -2, 1 << 20])
def test_truncate_prompt_tokens_out_of_range_is_a_400_naming_it(server, auth, model_name, http, keep):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2}),
                       ("/v1/embeddings", {"input": "hi"})):
        r = http.post(f"{server}{path}", json={"model": model_name, "truncate_prompt_tokens": keep, **body},
                      headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", (path, r.text)


def test_allowed_token_ids_keep_every_sampled_token_in_the_set(client, model_name, hf_tokenizer):
    """vLLM's allowed_token_ids: at temperature 1 every generated token is one of the allowed ids (each a whole
    word here, so the text is a sequence of those words), and greedy picks among them too."""
    words = [" red", " blue", " green"]
    ids = [hf_tokenizer.encode(w, add_special_tokens=False) for w in words]
    assert all(len(i) == 1 for i in ids)
    allowed = [i[0] for i in ids]
    for r in concurrently(*(lambda t=temperature: client.chat.completions.create(
            model=model_name, messages=QUESTION, temperature=t, seed=3, max_tokens=8,
            extra_body={"allowed_token_ids": allowed, "ignore_eos": True}) for temperature in (1.0, 0.0))):
        text = r.choices[0].message.content
        assert r.usage.completion_tokens == 8 and re.fullmatch(r"( red| blue| green){8}", text), text


def test_allowed_token_ids_that_min_tokens_holds_back_fail_that_request_alone(client, model_name, hf_tokenizer):
    """allowed_token_ids = [<|im_end|>] with min_tokens 4: the one allowed token is the stop token held back, so
    no token is left (it sampled token 0 from NaNs before): a 400 naming the cause, and the next request is served."""
    import openai

    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=8,
                                       extra_body={"allowed_token_ids": [eos], "min_tokens": 4})
    assert e.value.body["code"] == "no_token_to_sample" and "allowed_token_ids" in e.value.body["message"]
    ok = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_return_token_ids_are_the_prompt_and_the_tokens_generated(client, model_name, hf_tokenizer):
    """vLLM's return_token_ids: the prompt's ids (transformers' tokenizer and chat template on the same GGUF) and
    the generated ids, which decode to the text returned; a stream's chunks carry the same ids in order."""
    prompt = "The three primary colours are"
    kw = dict(model=model_name, prompt=prompt, max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole, chunks = concurrently(lambda: client.completions.create(**kw).choices[0],
                                 lambda: [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices])
    assert whole.prompt_token_ids == hf_tokenizer(prompt).input_ids
    assert len(whole.token_ids) == 8 and hf_tokenizer.decode(whole.token_ids) == whole.text
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert [t for c in chunks for t in c.token_ids or []] == whole.token_ids

    messages = [{"role": "user", "content": "Name a colour."}]
    rendered = hf_tokenizer(hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False).input_ids
    kw = dict(model=model_name, messages=messages, max_tokens=8, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    chat, stream, plain = concurrently(
        lambda: client.chat.completions.create(**kw), lambda: list(client.chat.completions.create(stream=True, **kw)),
        lambda: client.chat.completions.create(model=model_name, messages=messages, max_tokens=2))
    assert chat.prompt_token_ids == rendered
    assert hf_tokenizer.decode(chat.choices[0].token_ids) == chat.choices[0].message.content
    assert stream[0].prompt_token_ids == rendered
    assert [t for c in stream if c.choices for t in getattr(c.choices[0], "token_ids", None) or []] == \
        chat.choices[0].token_ids
    assert "prompt_token_ids" not in plain.model_dump() and "token_ids" not in plain.choices[0].model_dump()


def test_documents_reach_the_chat_template(server, auth, model_name, hf_tokenizer):
    """vLLM's `documents` (transformers' apply_chat_template(documents=...)): a retrieval template renders them
    (the prompt is exactly the reference rendering's tokens); the model's own template, which has no use for
    them, still answers."""
    template = ("{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    docs = [{"title": "A", "text": "alpha"}, {"title": "B", "text": "beta"}]
    body = {"model": model_name, "messages": [{"role": "user", "content": "Which letter?"}], "max_tokens": 1}
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60,
                   json=body | {"chat_template": template, "documents": docs})
    assert r.status_code == 200, r.text
    want = hf_tokenizer("[A: alpha][B: beta]Which letter?", add_special_tokens=False).input_ids
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60,
                      json=body | {"documents": docs}).status_code == 200
    big = [{"title": "x", "text": "y" * 4096}] * 300
    r = httpx.post(f"{server}/v1/chat/completions", headers=auth, timeout=60, json=body | {"documents": big})
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text


def test_bad_words_keep_a_word_out_of_the_answer(client, model_name):
    """vLLM's bad_words: the README's question names Paris; banned, the answer does not (streamed or not), and
    completions honour it too."""
    kw = dict(model=model_name, messages=QUESTION, temperature=0, max_tokens=24, extra_body={"bad_words": ["Paris"]})
    free, banned, streamed, text = concurrently(
        lambda: client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0, max_tokens=24),
        lambda: client.chat.completions.create(**kw).choices[0].message.content,
        lambda: _stream_text(client.chat.completions.create(stream=True, **kw)),
        lambda: client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=8,
                                          temperature=0, extra_body={"bad_words": ["Paris"]}).choices[0].text)
    assert "Paris" in free.choices[0].message.content
    assert "Paris" not in banned and streamed == banned
    assert "Paris" not in text


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client, model_name):
    """vLLM's return_tokens_as_token_ids: logprob entries name tokens "token_id:<id>", the ids the same
    response returns (return_token_ids), prompt tokens (echo) included; the alternatives too."""
    chat, done = concurrently(
        lambda: client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0,
            logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}),
        lambda: client.completions.create(
            model=model_name, prompt="Red, green and", max_tokens=4, temperature=0, echo=True, logprobs=1,
            extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0])
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(re.fullmatch(r"token_id:\d+", t.token) and bytes(t.bytes) == t.token.encode()
               for c in content for t in c.top_logprobs)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the chosen token is the top one
    assert done.logprobs.tokens == [f"token_id:{t}" for t in done.prompt_token_ids + done.token_ids]
    assert done.logprobs.token_logprobs[0] is None


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_masked_tokens_are_floored_as_vllm_does(client, model_name, hf_tokenizer, stream):
    """allowed_token_ids of two ids leaves the other top-5 alternatives at -inf: they come back as vLLM's floor,
    -9999.0 (JSON has no -inf: a body was a 500, a stream carried `-Infinity`), the two allowed ids finite."""
    allowed = [hf_tokenizer.encode(w, add_special_tokens=False)[0] for w in (" red", " blue")]
    kw = dict(model=model_name, messages=QUESTION, temperature=0, max_tokens=4, logprobs=True, top_logprobs=5,
              extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    if stream:
        entries = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content or []]
    else:
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(entries) == 4
    for e in entries:
        assert e.token in (" red", " blue") and -9999.0 < e.logprob <= 0
        values = sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert len(values) == 5 and all(-9999.0 < v <= 0 for v in values[:2]) and values[2:] == [-9999.0] * 3
