"""The served system on a GPU, through the OpenAI SDK, against the `serve run` that tests/gpu/serve_device.sh
starts (deploy/cluster-gpu.yaml with three random-weight models: tests/gpu/serve_device_models.py). Skipped
without CUDA (tests/gpu/conftest.py) and without that server (RAYLLM_GPU_SERVE_URL).

References, on the same GPU: transformers' fp32 model from the same files (logprobs, embeddings), PEFT on it
(the adapter), jsonschema and the SDK's own parsing, and the server's own answers (streaming against not,
a seed against itself). Placement: each engine names the GPU it steps on, the one Ray assigned its replica,
and the memory torch holds there (its stats); the ingress and tokenizer processes hold no CUDA context; and,
where nvidia-smi sees this machine's processes, GPU memory is the engines' alone. GPU faults: a KV need beyond the cache is a 400, and a
real CUDA out-of-memory in a step (forced on `tiny-faults`) fails that request while the replica serves on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

URL = os.environ.get("RAYLLM_GPU_SERVE_URL")
MODELS = Path(os.environ.get("RAYLLM_GPU_MODELS", "/tmp/models"))
TINY, BIG, ADAPTER, FAULTS = "tiny-llama", "llama-8b-shape", "gpu-lora", "tiny-faults"
FAULTS_CACHE_TOKENS = 8 * 64  # serve_device_models.FAULTS_BLOCKS x block size
# fp32 on both sides; our attention and LoRA kernels reduce in another order than torch's (and Triton's dots
# may use TF32): a few 1e-3 nats. A wrong token, position or adapter is off by whole nats.
TOL, LORA_TOL = 0.02, 0.05
QUESTION = [{"role": "user", "content": "Name three colours."}]
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"  # cpu: serve_device.sh's rehearsal (RAYLLM_GPU_REHEARSAL=1)

pytestmark = pytest.mark.skipif(not URL, reason="needs the server tests/gpu/serve_device.sh starts "
                                                "(RAYLLM_GPU_SERVE_URL)")


@pytest.fixture(scope="module")
def client():
    from openai import OpenAI

    return OpenAI(base_url=f"{URL}/v1", api_key=os.environ.get("RAYLLM_GPU_API_KEY", "unused"), max_retries=0,
                  timeout=300)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODELS / "tiny")


@pytest.fixture(scope="module")
def hf_tiny():
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 on the reference side
    return AutoModelForCausalLM.from_pretrained(MODELS / "tiny", dtype=torch.float32).to(DEVICE).eval()


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the carried tokenizer is byte-level BPE): byte -> the character for it."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


@pytest.fixture(scope="module")
def to_ids(tok):
    """Chat logprobs give each token's raw bytes (a random model often picks part of a UTF-8 character,
    whose text is not unique): back to ids through the tokenizer's own vocabulary."""
    decode = {c: b for b, c in gpt2_bytes_to_unicode().items()}
    added = set(tok.added_tokens_decoder)
    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        raw = piece.encode() if i in added else bytes(decode[c] for c in piece)
        by_bytes.setdefault(raw, []).append(i)

    def ids(entries) -> list[int]:
        found = [by_bytes[bytes(e.bytes)] for e in entries]
        assert all(len(f) == 1 for f in found), "two tokens with the same bytes"
        return [f[0] for f in found]

    return ids


def chat_ids(tok, messages=QUESTION) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def reference_logprobs(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    """The reference's log-softmax at each generated position ([len(ids) - n_prompt, V])."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=DEVICE)).logits[0].float()
    return logits.log_softmax(-1)[n_prompt - 1 : len(ids) - 1].cpu()


def check_against(ref: torch.Tensor, out_ids: list[int], logprobs: list[float], tol: float) -> None:
    for i, (t, lp) in enumerate(zip(out_ids, logprobs, strict=True)):
        assert lp == pytest.approx(ref[i, t].item(), abs=tol), f"position {i}"


def test_chat_logprobs_match_transformers_on_cuda_and_completions_agree(client, tok, hf_tiny, to_ids):
    c = client.chat.completions.create(model=TINY, messages=QUESTION, max_tokens=16, temperature=0, logprobs=True,
                                       top_logprobs=3).choices[0]
    out_ids = to_ids(c.logprobs.content)
    prompt_ids = chat_ids(tok)
    ref = reference_logprobs(hf_tiny, prompt_ids + out_ids, len(prompt_ids))
    check_against(ref, out_ids, [t.logprob for t in c.logprobs.content], TOL)
    for i, t in enumerate(out_ids):  # greedy: the reference's top token, unless two are within the tolerance
        top2 = ref[i].topk(2).values
        assert t == ref[i].argmax().item() or (top2[0] - top2[1]).item() < TOL
    # The same tokens as a completion of the rendered prompt's ids: the same answer.
    r = client.completions.create(model=TINY, prompt=prompt_ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == c.message.content and r.usage.prompt_tokens == len(prompt_ids)


def test_chat_streams_what_it_answers_and_n_choices_sample_the_reference(client, tok, hf_tiny, to_ids):
    ask = dict(model=TINY, messages=QUESTION, max_tokens=16)
    full = client.chat.completions.create(temperature=0, **ask).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(temperature=0, stream=True, **ask)
             if c.choices]
    assert "".join(parts) == full and len(parts) > 1
    r = client.chat.completions.create(n=3, temperature=1.0, seed=7, logprobs=True, **ask)
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in r.choices)
    prompt_ids = chat_ids(tok)
    for choice in r.choices:  # each sampled token's logprob is the reference model's (temperature 1)
        out_ids = to_ids(choice.logprobs.content)
        ref = reference_logprobs(hf_tiny, prompt_ids + out_ids, len(prompt_ids))
        check_against(ref, out_ids, [t.logprob for t in choice.logprobs.content], TOL)


def test_seeded_sampling_is_reproducible(client):
    ask = dict(model=TINY, messages=QUESTION, max_tokens=24, temperature=1.0, top_p=0.95)
    same = [client.chat.completions.create(seed=123, **ask).choices[0].message.content for _ in range(2)]
    other = client.chat.completions.create(seed=124, **ask).choices[0].message.content
    assert same[0] == same[1] and other != same[0]


def test_json_schema_and_tools_are_honoured(client):
    import jsonschema

    # Bounded values only: a random model need never end an open string within max_tokens.
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"},
                                               "count": {"enum": [1, 2, 3]}},
              "required": ["colour", "bright", "count"], "additionalProperties": False}
    r = client.chat.completions.create(model=TINY, messages=QUESTION, max_tokens=64, temperature=1.0, seed=1,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    tool = {"type": "function", "function": {"name": "set_light", "description": "Switch a light",
                                             "parameters": schema}}
    r = client.chat.completions.create(model=TINY, messages=QUESTION, max_tokens=64, temperature=1.0, seed=2,
                                       tools=[tool], tool_choice={"type": "function", "function": {"name": "set_light"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "set_light"
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_lora_adapter_matches_peft(client, tok, hf_tiny, to_ids):
    from peft import PeftModel

    path = str(MODELS / "adapters" / ADAPTER)
    ask = dict(model=TINY, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True)
    c = client.chat.completions.create(extra_body={"lora_path": path}, **ask).choices[0]
    out_ids = to_ids(c.logprobs.content)
    prompt_ids = chat_ids(tok)
    peft = PeftModel.from_pretrained(hf_tiny, path).eval()
    try:
        ref = reference_logprobs(peft, prompt_ids + out_ids, len(prompt_ids))
        with peft.disable_adapter():
            base = reference_logprobs(peft, prompt_ids + out_ids, len(prompt_ids))
    finally:
        peft.unload()  # the module's reference model is the base one again
    check_against(ref, out_ids, [t.logprob for t in c.logprobs.content], LORA_TOL)
    assert (ref - base).abs().max().item() > 10 * LORA_TOL  # the adapter changes the answer's distribution


def test_embeddings_are_the_reference_final_hidden_state(client, tok, hf_tiny):
    ids = tok("A sentence to embed.").input_ids
    got = torch.tensor(client.embeddings.create(model=TINY, input=[ids]).data[0].embedding)
    with torch.no_grad():  # LlamaModel's output: after the final norm, as our pooling reads it
        hidden = hf_tiny.model(torch.tensor([ids], device=DEVICE)).last_hidden_state[0, -1]
    ref = torch.nn.functional.normalize(hidden.float().cpu(), dim=0)
    assert got.shape == ref.shape and torch.dot(got, ref).item() > 0.9999


def test_responses_answers_as_chat_does(client):
    chat = client.chat.completions.create(model=TINY, messages=QUESTION, max_tokens=12, temperature=0)
    r = client.responses.create(model=TINY, input=QUESTION[0]["content"], max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text == chat.choices[0].message.content


def test_the_8b_shape_serves_long_prompts_and_batches(client):
    """The speed model answers through the same config: a prompt over one 8k step budget (chunked prefill)
    and a batch of concurrent requests, every one to its last token (random bf16 weights: greedy answers may
    tie differently in another batch, so no text is compared)."""
    from concurrent.futures import ThreadPoolExecutor

    long = [{"role": "user", "content": "word " * 9000}]
    r = client.chat.completions.create(model=BIG, messages=long, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > 8192 and r.usage.completion_tokens == 4
    ask = dict(model=BIG, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(32)]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda m: client.chat.completions.create(messages=m, **ask), prompts))
    assert all(x.usage.completion_tokens == 16 and x.choices[0].finish_reason == "length" for x in together)


def test_kv_beyond_the_cache_is_a_400_and_a_cuda_oom_in_a_step_fails_only_its_request(client):
    import openai

    ask = dict(model=FAULTS, messages=QUESTION, temperature=0)
    with pytest.raises(openai.BadRequestError) as caught:  # refused before any step
        client.chat.completions.create(max_tokens=FAULTS_CACHE_TOKENS, **ask)
    assert caught.value.param == "max_tokens" and "tokens of KV cache" in caught.value.body["message"]
    with pytest.raises(openai.InternalServerError) as caught:  # its first step allocates twice the card
        client.chat.completions.create(max_tokens=8, **ask)
    err = caught.value
    assert err.status_code == 503 and err.code == "out_of_memory", err.body
    if CUDA:
        assert "CUDA out of memory" in err.body["message"], err.body  # torch's message for a refused allocation
    r = client.chat.completions.create(max_tokens=8, **ask)  # the same replica serves on
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens == 0


def serve_processes() -> dict[str, list[int]]:
    """Pids of this machine's Serve replicas by deployment (Ray titles them ray::ServeReplica:<app>:<name>)."""
    import re

    import psutil

    found: dict[str, list[int]] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = re.match(r"ray::ServeReplica:[^:]+:([A-Za-z0-9_-]+)", " ".join(p.info["cmdline"] or []))
        if title:
            found.setdefault(title.group(1), []).append(p.info["pid"])
    return found


def family(pid: int) -> list[int]:
    import psutil

    return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]


def visible_devices(pid: int) -> str:
    """CUDA_VISIBLE_DEVICES as the replica's engine process started with it. Ray sets the variable in the
    replica's os.environ after the process started, so /proc shows it only in the engine child that the replica
    starts with it (engine_process.child_env)."""
    import psutil

    for p in family(pid):
        value = psutil.Process(p).environ().get("CUDA_VISIBLE_DEVICES")
        if value:
            return value
    raise AssertionError(f"no process of replica {pid} started with CUDA_VISIBLE_DEVICES")


ENGINES, SERVING = ("llm", f"llm-{TINY}", f"llm-{FAULTS}"), ("ingress", "tokenizer")


@pytest.fixture(scope="module")
def replicas() -> dict[str, int]:
    """The pid of each deployment's one replica (serve_device_models' config runs one of each)."""
    procs = serve_processes()
    assert {*ENGINES, *SERVING} <= set(procs) and all(len(procs[n]) == 1 for n in (*ENGINES, *SERVING)), procs
    return {name: pids[0] for name, pids in procs.items()}


@pytest.fixture(scope="module")
def engine_stats() -> Iterator[dict[str, dict]]:
    """Each model deployment's engine stats through a Serve handle: the engine names, from inside its own
    process, the GPU it steps on and the memory torch holds there (no process table, so no PID namespace, in
    the way)."""
    import asyncio

    import ray
    from ray import serve

    async def read() -> dict[str, dict]:  # in an event loop: serving.env routes a handle from its caller's loop
        return {name: await serve.get_deployment_handle(name, app_name="llm").engine_stats.remote() for name in ENGINES}

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    try:
        yield asyncio.run(asyncio.wait_for(read(), timeout=60))
    finally:
        ray.shutdown()


def test_engines_step_on_the_gpu_ray_assigned_their_replica(replicas, engine_stats):

    from tests.gpu.gpu_procs import assigned_uuids, gpu_uuids

    uuids = gpu_uuids() if CUDA else {}
    for name in ENGINES:
        stats = engine_stats[name]
        if not CUDA:  # the rehearsal's CPU engines: the stats path, and nothing on a GPU
            assert (stats["device_uuid"], stats["device_reserved_bytes"]) == ("", 0), stats
            continue
        assigned = assigned_uuids(visible_devices(replicas[name]), uuids)
        assert stats["device_uuid"] in assigned, (name, stats["device_uuid"], assigned)
        assert stats["device_reserved_bytes"] > 0, (name, stats)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (serve_device.sh's CPU rehearsal skips it)")
def test_ingress_and_tokenizer_processes_hold_no_cuda_context(replicas):
    from tests.gpu.gpu_procs import CUDA_CONTEXT_FILE, open_device_files

    def contexts(name: str) -> list[int]:
        return [p for p in family(replicas[name]) if CUDA_CONTEXT_FILE in open_device_files(p)]

    if not all(contexts(name) for name in ENGINES):  # the probe's own check: the engines do hold one
        pytest.skip(f"the engines' CUDA contexts do not show in /proc/PID/fd as {CUDA_CONTEXT_FILE} here: "
                    f"{ {name: contexts(name) for name in ENGINES} }")
    for name in SERVING:
        assert not contexts(name), f"{name}: a process of replica {replicas[name]} holds a CUDA context"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (serve_device.sh's CPU rehearsal skips it)")
def test_nvidia_smi_sees_gpu_memory_in_the_engines_alone(replicas):
    """The driver's own table, where it can see this machine's processes: in a container with its own PID
    namespace it lists none of them (or host PIDs), and the test says so instead of failing."""

    from tests.gpu.gpu_procs import assigned_uuids, compute_apps, gpu_uuids

    held = compute_apps()
    ours = {pid for name in (*ENGINES, *SERVING) for pid in family(replicas[name])}
    if not held.keys() & ours:
        pytest.skip(f"nvidia-smi lists none of this machine's serving processes (a PID namespace of its own): "
                    f"{held or 'no processes'}")
    uuids = gpu_uuids()
    for name in ENGINES:
        assigned = assigned_uuids(visible_devices(replicas[name]), uuids)
        engines = [p for p in family(replicas[name]) if p in held]
        assert engines, f"{name}: no process of replica {replicas[name]} holds GPU memory ({held})"
        assert all(held[p][0] in assigned for p in engines), (name, engines, held, assigned)
    for name in SERVING:
        assert not [p for p in family(replicas[name]) if p in held], f"{name}: holds GPU memory ({held})"
