"""Several base models in one app (cluster.yaml `models:`): tiny directories with RANDOM weights (built by
transformers in the test, SmolLM2's tokenizer saved beside each: ops_apps.multi_args) behind one ingress and
one tokenizer deployment, each model on its own deployment with its own replica count: the first family's
tiny model first ("llm"), then a tiny Llama on two replicas. Which model answers shows in its tokens, so
random weights serve as well as real ones here.

References: each model's greedy answer is transformers' `generate` on the same checkpoint and the prompt its
own chat template renders."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ADMIN_KEY, API_KEY
from ops_apps import FAMILIES, LLAMA31, MODEL, multi_args

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 8
TINY = LLAMA31  # the tiny Llama, on two replicas, with a LoRA slot
FIRST = f"tiny-{FAMILIES[0]}"  # the first model: deployment "llm", alias "first"
MODELS = {f"tiny-{family}" for family in FAMILIES} | {TINY}


@pytest.fixture(scope="module")
def tiny_path(tiny_models) -> str:
    return tiny_models[TINY]


@pytest.fixture(scope="module")
def multi(request, shared_apps, tiny_models) -> str:
    """The several-model app; the tiny Llama runs two replicas, the others one (test_model_families.py's
    models are in it too)."""
    return shared_apps.get(request, "multi", multi_args(tiny_models))


def greedy_reference(path: str, messages: list[dict], max_tokens: int) -> str:
    """transformers' greedy answer of the checkpoint at `path` (fp32) to `messages`, rendered by the chat
    template of its own tokenizer, stopping at SmolLM2's end ids (the tiny models' vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False).input_ids
    stop = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop[0])
    return tok.decode([t for t in out[0, len(ids):].tolist() if t not in stop], skip_special_tokens=True)


def test_two_models_answer_concurrently_each_with_its_own_output(multi, tiny_models, hf_tokenizer):
    from openai import OpenAI

    multi_client = OpenAI(base_url=f"{multi}/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def ask(c: OpenAI, model: str) -> str:
        r = c.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
        assert r.model == model
        return r.choices[0].message.content

    with ThreadPoolExecutor(4) as pool:  # both models at once, each twice (by name and by alias)
        futures = {m: pool.submit(ask, multi_client, m) for m in (FIRST, TINY, "first", "tiny")}
        answers = {m: f.result() for m, f in futures.items()}
    assert answers[FIRST] == greedy_reference(tiny_models[FAMILIES[0]], QUESTION, MAX_TOKENS)
    assert answers[TINY] == greedy_reference(tiny_models[TINY], QUESTION, MAX_TOKENS)
    assert answers["first"] == answers[FIRST] and answers["tiny"] == answers[TINY]
    assert answers[FIRST] != answers[TINY]
    # The completions route and the tokenizer route go to the named model too (its own tokenizer info: the
    # first model's max_model_len is 256).
    text = multi_client.completions.create(model="tiny", prompt="Red, green", max_tokens=4, temperature=0)
    assert text.model == "tiny" and text.usage.prompt_tokens == len(hf_tokenizer("Red, green").input_ids)
    tok = httpx.post(f"{multi}/tokenize", json={"model": TINY, "prompt": "Red"},
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert tok["max_model_len"] == 1024


def test_models_lists_every_model_and_alias_and_unknown_is_404(multi):
    from openai import NotFoundError, OpenAI

    c = OpenAI(base_url=f"{multi}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    cards = {m.id: m for m in c.models.list().data}
    assert set(cards) == MODELS | {"first", "tiny"}
    assert cards["first"].root == FIRST and cards["tiny"].root == TINY
    assert c.models.retrieve("tiny").root == TINY
    with pytest.raises(NotFoundError) as err:
        c.chat.completions.create(model="nope", messages=QUESTION, max_tokens=2)
    body = err.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert all(name in body["message"] for name in (*MODELS, "first", "tiny"))


def test_each_model_has_its_own_replicas(multi):
    """Two replicas for the tiny Llama leave the first model's deployment at one (serve.status())."""
    from ray import serve

    deployments = serve.status().applications["multi"].deployments
    assert set(deployments) == {"ingress", "tokenizer"} | {"llm" if m == FIRST else f"llm-{m}" for m in MODELS}
    assert deployments["llm"].replica_states == {"RUNNING": 1}
    assert deployments["llm-tiny-llama"].replica_states == {"RUNNING": 2}


def admin(base: str, route: str, body: dict) -> httpx.Response:
    """The LoRA admin routes (admin key)."""
    return httpx.post(f"{base}/v1/{route}", json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=120)


def test_an_adapter_loads_and_unloads_at_runtime_on_the_second_model(multi, tiny_path):
    """The load body's `model` (a base model's name or alias; default the first) picks the model whose
    replicas load the adapter; the adapter then answers on that model, and an unload without `model` finds it."""
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    def ask(model: str) -> httpx.Response:
        return httpx.post(f"{multi}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0},
                          timeout=120)

    path = random_peft_adapter(str(Path(tiny_path).parent / "tiny-poet"), read_arch(tiny_path), rank=4, seed=5)
    r = admin(multi, "load_lora_adapter", {"lora_name": "tiny-poet", "lora_path": path, "model": "tiny"})
    assert r.status_code == 200, r.text
    base, poet = ask(TINY).json(), ask("tiny-poet").json()
    assert poet["model"] == "tiny-poet", poet
    assert poet["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    for body, status, code, param in (
        ({"lora_name": "tiny-poet", "lora_path": path}, 400, "lora_adapter_exists", "lora_name"),  # another model's
        ({"lora_name": "x", "lora_path": path, "model": "nope"}, 404, "model_not_found", "model"),
    ):
        r = admin(multi, "load_lora_adapter", body)
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (status, code, param), r.text
    assert admin(multi, "unload_lora_adapter", {"lora_name": "tiny-poet"}).status_code == 200
    assert ask("tiny-poet").status_code == 404


def test_an_adapter_may_not_take_a_models_name_or_alias(multi, tiny_path):
    """Requests address an adapter by its bare name, so a model's name or alias is refused as one (it would
    reach the model, and /v1/models would list the name twice); nothing is loaded."""
    for name, model, owner in (("first", "tiny", FIRST), ("tiny", None, TINY)):
        body = {"lora_name": name, "lora_path": str(Path(tiny_path).parent / "any")}
        r = admin(multi, "load_lora_adapter", body | ({"model": model} if model else {}))
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "lora_name" and f"of model {owner!r}" in error["message"]


def test_models_without_a_running_replica_are_listed_at_once(server, apps, tiny_path):
    """/v1/models is what clients poll for readiness. Two models whose replicas cannot be placed (they ask
    for a resource no node has: Serve keeps them starting, UPDATING with none running) are listed at once with
    their configured max_model_len, without a call that would wait for a replica (it waited for Serve's
    request timeout); so is each one's own card."""
    from openai import OpenAI
    from ray import serve

    from tests.serve.ops_apps import SMALL_ENGINE, small_app

    nowhere = {"ray_actor_options": {"num_cpus": 0, "resources": {"rayllm_test_absent": 1}}}
    tiny = {"model": {"model": tiny_path, "dtype": "float32", "max_model_len": 256}}
    app = small_app({"api_keys": [API_KEY], "models": [
        {"engine": SMALL_ENGINE, "aliases": ["smol"], "deployment": nowhere},
        {"served_model_name": TINY, "engine": tiny, "deployment": nowhere}]})
    # Not serve.run: it waits for the app to be RUNNING, which it never is.
    serve.run_many([serve.RunTarget(app, name="unplaced", route_prefix="/unplaced")],
                   wait_for_applications_running=False)
    apps.append("unplaced")
    base = f"{server}/unplaced"
    c = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    deadline = time.monotonic() + 300
    while True:  # the ingress is up once an unknown model is its 404 (a route that calls no model), not Serve's
        try:
            r = httpx.get(f"{base}/v1/models/nope", headers={"Authorization": f"Bearer {API_KEY}"})
            if r.status_code == 404 and "model_not_found" in r.text:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the app's ingress did not start"
        time.sleep(0.5)
    deployments = serve.status().applications["unplaced"].deployments
    for name in ("llm", "llm-tiny-llama"):
        assert deployments[name].status == "UPDATING" and not deployments[name].replica_states.get("RUNNING")
    t0 = time.monotonic()
    cards = {m.id: m for m in c.models.list().data}
    assert time.monotonic() - t0 < 10
    assert {k: (m.root, m.max_model_len) for k, m in cards.items()} == {
        MODEL: (MODEL, 1024), "smol": (MODEL, 1024), TINY: (TINY, 256)}
    assert (c.models.retrieve("smol").max_model_len, c.models.retrieve(TINY).max_model_len) == (1024, 256)
    assert time.monotonic() - t0 < 15
