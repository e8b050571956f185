"""The real app serving the added families: a tiny random Qwen3 and a tiny random Mixtral directory
(weights random, built by transformers in the test; SmolLM2's tokenizer saved beside them so chat
templates render) each answer a chat completion through the OpenAI SDK with the tokens transformers'
own greedy `generate` picks for the same rendered prompt. A tiny random Llama whose tokenizer carries
Llama 3.1 Instruct's chat template (in the same app: ops_apps.LLAMA31) calls tools in Llama's own format."""

from __future__ import annotations

import jsonschema
import pytest
import torch
from conftest import API_KEY
from ops_apps import FAMILIES, LLAMA31, multi_args
from test_tools import ASK, PARAMS, TOOLS

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def families(request, shared_apps, tiny_models) -> tuple[str, dict[str, str]]:
    """test_multi_model.py's app, which serves every family's tiny model beside its own (a `models` list:
    each on its own model deployment), so their replicas start together; its URL and the models' folders."""
    return shared_apps.get(request, "multi", multi_args(tiny_models)), tiny_models


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_completion_on_a_tiny_random_model(families, hf_tokenizer, family):
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    base, paths = families
    path = paths[family]
    client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.chat.completions.create(model=f"tiny-{family}", messages=QUESTION, max_tokens=MAX_TOKENS,
                                       temperature=0)

    prompt = hf_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = hf_tokenizer(prompt, add_special_tokens=False).input_ids
    stop = [hf_tokenizer.eos_token_id, hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop[0])
    new = [t for t in out[0, len(ids):].tolist() if t not in stop]
    assert r.model == f"tiny-{family}"
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason == ("length" if len(new) == MAX_TOKENS else "stop")
    if len(new) == MAX_TOKENS:
        assert r.usage.completion_tokens == MAX_TOKENS
    assert r.choices[0].message.content == hf_tokenizer.decode(new, skip_special_tokens=True)


# ---- Llama 3.x's own tool format ----------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_llama_template_model_calls_in_its_format(families, tool_choice):
    """The tiny Llama with RANDOM weights whose tokenizer (SmolLM2's) carries Llama 3.1 Instruct's chat template:
    the server finds the tool format in that template, as it would for the real model. required / named write
    Llama's `{"name": ..., "parameters": ...}` (the tokens show it), and the OpenAI SDK parses the calls, whole
    and streamed, for strict tools."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{families[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    kw = dict(model=LLAMA31, messages=ASK, tools=strict, tool_choice=tool_choice, parallel_tool_calls=False,
              temperature=0, max_tokens=120)
    r = client.chat.completions.parse(logprobs=True, **kw)
    choice = r.choices[0]
    raw = "".join(t.token for t in choice.logprobs.content)
    (call,) = choice.message.tool_calls
    assert raw.startswith(f'{{"name": "{call.function.name}", "parameters": '), raw
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    jsonschema.validate(call.function.parsed_arguments, PARAMS[call.function.name])
    assert isinstance(tool_choice, str) or call.function.name == "get_time"
    with client.chat.completions.stream(**kw) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.parsed_arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.parsed_arguments)]
