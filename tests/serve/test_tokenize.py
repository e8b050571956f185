"""vLLM's /tokenize with chat messages, through the real app: every body /v1/chat/completions takes renders to the
very prompt that chat sends the model (its `return_token_ids`), continue_final_message, tools and a request's
chat_template included; `return_token_strs` adds each token's vocabulary entry (transformers'
convert_ids_to_tokens on the same GGUF)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.serve.conftest import API_KEY

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

PARTIAL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"


def tokenize(base: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/tokenize", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def chat_prompt_ids(client, model_name: str, **kw) -> list[int]:
    """The prompt /v1/chat/completions renders for these fields (vLLM's return_token_ids), through the SDK."""
    messages = kw.pop("messages")
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, temperature=0,
                                       extra_body={"return_token_ids": True, **kw.pop("extra_body", {})}, **kw)
    return r.prompt_token_ids


@pytest.mark.parametrize("fields", [
    {"continue_final_message": True},  # add_generation_prompt's default gives way, as in chat (was a 400)
    {"continue_final_message": True, "add_generation_prompt": False},
    {"tools": TOOLS},
    {"chat_template": TEMPLATE},
])
def test_a_chat_body_tokenizes_to_the_prompt_chat_sends(server, client, model_name, fields):
    messages = PARTIAL if fields.get("continue_final_message") else PARTIAL[:1]
    r = tokenize(server, {"model": model_name, "messages": messages} | fields)
    assert r.status_code == 200, r.text
    tools = {"tools": fields["tools"]} if "tools" in fields else {}
    extra = {k: v for k, v in fields.items() if k != "tools"}
    want = chat_prompt_ids(client, model_name, messages=messages, extra_body=extra, **tools)
    assert r.json()["tokens"] == want and r.json()["count"] == len(want)
    plain = tokenize(server, {"model": model_name, "messages": messages}).json()["tokens"]
    assert plain != want  # each field changed the prompt


def test_continue_final_message_ends_on_the_partial_answer(server, model_name, hf_tokenizer):
    """The reference: transformers' chat template on the same GGUF, continuing the assistant's message."""
    r = tokenize(server, {"model": model_name, "messages": PARTIAL, "continue_final_message": True})
    text = hf_tokenizer.apply_chat_template(PARTIAL, tokenize=False, continue_final_message=True)
    assert r.json()["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids
    assert hf_tokenizer.decode(r.json()["tokens"]).endswith("My favourite is")


def test_return_token_strs_are_the_vocabulary_entries(server, model_name, hf_tokenizer):
    for body in ({"prompt": "Hello wonderful world"}, {"messages": PARTIAL[:1]}):
        r = tokenize(server, {"model": model_name, "return_token_strs": True} | body).json()
        assert r["token_strs"] == hf_tokenizer.convert_ids_to_tokens(r["tokens"]) and len(r["token_strs"]) > 2
        assert "token_strs" not in tokenize(server, {"model": model_name} | body).json()


@pytest.mark.parametrize("body, param", [
    ({"messages": PARTIAL, "continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": PARTIAL[:1], "continue_final_message": True}, "continue_final_message"),
    ({"messages": PARTIAL[:1], "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools.0.function"),
])
def test_chat_refusals_are_chats(server, client, model_name, body, param):
    """What chat refuses, /tokenize refuses with the same field named."""
    r = tokenize(server, {"model": model_name} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    fields = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    with pytest.raises(openai.BadRequestError) as exc:
        chat_prompt_ids(client, model_name, messages=body["messages"], extra_body=fields,
                        **({"tools": body["tools"]} if "tools" in body else {}))
    assert exc.value.body["param"] == param


def test_a_request_template_follows_the_servers_switch(fp32_server, model_name):
    """allow_request_chat_template off (the default, as on this app): refused as chat refuses it."""
    r = tokenize(fp32_server, {"model": model_name, "messages": PARTIAL[:1], "chat_template": TEMPLATE})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("chat_template", "chat_template_not_allowed")
