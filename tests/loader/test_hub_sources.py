"""Hugging Face ids as model sources, against a local server that speaks the Hub's HTTP API (hub_server.py)
with HF_ENDPOINT pointed at it: huggingface_hub itself does the talking, in a fresh process per load (as a
replica is) so that HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE are read as in production.

The models are random-weight Llamas built with transformers (the weights are random: only the bytes and
the config matter), and the real SmolLM2 GGUF for a GGUF repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.loader.hub_server import HubServer

TOKEN = "hf_test_secret"
LOADER = """
import json, os, sys
from rayllm.loader.model_files import resolve_model_path
try:
    path = resolve_model_path(sys.argv[1], sys.argv[2] or None)
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    files = sorted(os.listdir(path)) if os.path.isdir(path) else [os.path.basename(path)]
    print(json.dumps({"path": path, "files": files}))
"""


def _llama_files(layers: int, save_to: str | None = None, **save) -> dict[str, bytes]:
    """config.json and safetensors of a random-weight Llama with `layers` layers (`save`: save_pretrained's
    options, e.g. max_shard_size for an index and shards), also kept in `save_to`."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(save_to or d, safe_serialization=True, **save)  # random weights
        return {f: open(os.path.join(save_to or d, f), "rb").read() for f in os.listdir(save_to or d)}


def _mistral_consolidated(files: dict[str, bytes]) -> bytes:
    """The same weights under Mistral's own tensor names, as Mistral repos ship beside the Hugging Face ones."""
    from safetensors.torch import load, save

    tensors = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            for key, t in load(data).items():
                key = key.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq")
                tensors[key.replace("model.embed_tokens", "tok_embeddings").replace("lm_head", "output")] = t
    return save(tensors)


def _tokenizer_files(gguf_path: str) -> dict[str, bytes]:
    """The default model's tokenizer and chat template as a Hugging Face repository holds them."""
    import tempfile

    from rayllm.serve.chat_template import load_tokenizer

    with tempfile.TemporaryDirectory() as d:
        load_tokenizer(gguf_path).save_pretrained(d)
        return {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}


def _adapter_files(gguf_path: str, folder: str) -> dict[str, bytes]:
    """A PEFT adapter (random weights) for the default model."""
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    random_peft_adapter(folder, read_arch(gguf_path), rank=4, seed=1, targets=("q_proj",))
    return {f: open(os.path.join(folder, f), "rb").read() for f in os.listdir(folder)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gguf_path):
    extra = {"README.md": b"# tiny", "pytorch_model.bin": b"\0" * 1024, "original/consolidated.00.pth": b"x"}
    gguf = open(gguf_path, "rb").read()
    sharded_dir = tmp_path_factory.mktemp("sharded")
    sharded = _llama_files(2, str(sharded_dir), max_shard_size="20KB")
    tokenizer = _tokenizer_files(gguf_path)
    adapter = _adapter_files(gguf_path, str(tmp_path_factory.mktemp("adapter")))
    server = HubServer(
        {"acme/tiny-llama": {"main": _llama_files(2) | extra, "v1": _llama_files(1) | extra},
         "acme/smol-gguf": {"main": {os.path.basename(gguf_path): gguf, "other.Q8_0.gguf": b"GGUF" + b"\0" * 64,
                                     "README.md": b"# gguf"}},
         "acme/one-gguf": {"main": {"Smol.Q4_1.GGUF": gguf, "README.md": b"# one", "sub/other.gguf": b"GGUF"}},
         # Mistral's layout: HF shards and their index, consolidated.safetensors beside them, more in subfolders.
         "acme/sharded": {"main": sharded | {"consolidated.safetensors": _mistral_consolidated(sharded),
                                             "original/model.safetensors": b"x", "model.Q8_0.gguf": b"GGUF"}},
         "acme/chat-llama": {"main": _llama_files(2) | tokenizer},
         "acme/adapter": {"main": adapter | {"README.md": b"# adapter", "extra.safetensors": sharded[min(sharded)],
                                             "sub/adapter_model.safetensors": b"x"}},
         "acme/private": {"main": _llama_files(1)}},
        private={"acme/private": TOKEN})
    server.sharded_dir, server.tokenizer_files = str(sharded_dir), tokenizer
    yield server
    server.close()


# The app build as Serve's build task runs it: what each deployment is bound with.
BUILD = """
import json, sys
from rayllm.serve.builder import build_app_with
from rayllm.serve.config import ServerConfig
engine = {"model": {"model": sys.argv[1], "served_model_name": "m"}, "parallel": {"device": "cpu"}}
ingress = build_app_with(ServerConfig.from_args({"engine": engine}))._bound_deployment
llm = ingress.init_kwargs["llms"]["m"]._bound_deployment
print(json.dumps({"llm": llm.init_args[1], "engine": [llm.init_args[0].model.model, llm.init_args[0].model.revision],
                  "tokenizer": ingress.init_kwargs["tokenizer"]._bound_deployment.init_args[0],
                  "ingress": ingress.init_args[0].engine.model.model}))
"""
CHECK = "import json, sys; from rayllm.loader import model_sources as m; print(json.dumps(m.check(sys.argv[1])))"
# A tokenizer replica, and one render with the model's own template.
TOKENIZER = """
import asyncio, json, sys
from rayllm.serve.tokenizer import TokenizerDeployment
replica = TokenizerDeployment.func_or_class({"m": sys.argv[1]})
text, ids = asyncio.run(replica.render_chat("m", [{"role": "user", "content": "Hi there"}]))
print(json.dumps({"path": replica.services["m"].model_path, "text": text, "ids": ids}))
"""


def run(hub: HubServer, home, script: str, *args: str, **env) -> dict:
    """`script` in a fresh process (as a replica is) against the hub, with `home` as its HF_HOME (its node)."""
    run_env = os.environ.copy()
    for k in ("HF_TOKEN", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        run_env.pop(k, None)
    run_env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"} | env
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=run_env,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def load(hub: HubServer, home, source: str, revision: str = "", **env) -> dict:
    return run(hub, home, LOADER, source, revision, **env)


def _layers(path: str) -> int:
    return json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]


def test_hub_id_downloads_only_the_needed_files_and_loads(hub, tmp_path):
    from rayllm.loader.loader import read_arch

    hub.downloads.clear()
    got = load(hub, tmp_path, "acme/tiny-llama")
    assert got["files"] == ["config.json", "generation_config.json", "model.safetensors"]
    assert {p for _, _, p in hub.downloads} == set(got["files"])  # no README, .bin or original/ weights
    assert _layers(got["path"]) == 2 and read_arch(got["path"]).num_layers == 2
    # Again: huggingface_hub's cache answers (no file is downloaded twice).
    hub.downloads.clear()
    assert load(hub, tmp_path, "acme/tiny-llama")["path"] == got["path"] and hub.downloads == []


def test_revision_from_config_or_the_id(hub, tmp_path):
    by_config = load(hub, tmp_path, "acme/tiny-llama", "v1")
    by_id = load(hub, tmp_path, "acme/tiny-llama@v1")
    assert by_config["path"] == by_id["path"] and _layers(by_id["path"]) == 1
    assert hub.commits[("acme/tiny-llama", "v1")] in by_id["path"]  # the snapshot of v1's commit
    missing = load(hub, tmp_path, "acme/tiny-llama@v9")
    assert "ModelSourceError" in missing["error"] and "acme/tiny-llama@v9" in missing["error"]


def test_offline_uses_the_cache_and_fails_clearly_without_it(hub, tmp_path):
    online = load(hub, tmp_path, "acme/tiny-llama")
    hub.downloads.clear()
    offline = load(hub, tmp_path, "acme/tiny-llama", HF_HUB_OFFLINE="1")
    assert offline["path"] == online["path"] and hub.downloads == []
    cold = load(hub, tmp_path / "empty", "acme/tiny-llama", HF_HUB_OFFLINE="1")
    assert "ModelSourceError" in cold["error"] and "acme/tiny-llama" in cold["error"]


def test_private_repo_401_without_token_loads_with_hf_token(hub, tmp_path):
    denied = load(hub, tmp_path, "acme/private")
    assert "ModelSourceError" in denied["error"] and "'acme/private'" in denied["error"]
    assert "HF_TOKEN" in denied["error"]
    assert _layers(load(hub, tmp_path, "acme/private", HF_TOKEN=TOKEN)["path"]) == 1
    unknown = load(hub, tmp_path, "acme/no-such-model")
    assert "ModelSourceError" in unknown["error"] and "acme/no-such-model" in unknown["error"]


def test_one_named_gguf_of_a_repo(hub, tmp_path, gguf_path):
    from rayllm.loader.loader import read_arch

    hub.downloads.clear()
    name = os.path.basename(gguf_path)
    got = load(hub, tmp_path, f"acme/smol-gguf/{name}")
    assert got["files"] == [name] and [p for _, _, p in hub.downloads] == [name]
    assert read_arch(got["path"]).num_layers == read_arch(gguf_path).num_layers
    with open(got["path"], "rb") as a, open(gguf_path, "rb") as b:
        assert a.read() == b.read()
    # A repo of several GGUFs named without the file: a start-up error that says to name one, before any
    # of them is downloaded (a repo of 25 quantizations is 100+ GB).
    hub.downloads.clear()
    many = load(hub, tmp_path, "acme/smol-gguf")
    assert "2 GGUF files" in many["error"] and "acme/smol-gguf" in many["error"] and hub.downloads == []
    # One GGUF at the top (any case; one in a subfolder does not count): the repo is that GGUF.
    one = load(hub, tmp_path, "acme/one-gguf")
    assert one["files"] == ["Smol.Q4_1.GGUF"] and [p for _, _, p in hub.downloads] == ["Smol.Q4_1.GGUF"]
    assert read_arch(one["path"]).num_layers == read_arch(gguf_path).num_layers


def test_sharded_repo_fetches_the_shards_its_index_names_and_loads(hub, tmp_path):
    """Not consolidated.safetensors (Mistral's names: a load error beside the shards), not a subfolder's
    safetensors, not a GGUF beside a config.json: the logits are transformers' own on the original folder."""
    import torch
    from transformers import LlamaForCausalLM

    from rayllm.executor.executor import make_executor
    from rayllm.loader.loader import read_arch
    from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    hub.downloads.clear()
    got = load(hub, tmp_path, "acme/sharded")
    shards = set(json.load(open(os.path.join(hub.sharded_dir, "model.safetensors.index.json")))["weight_map"].values())
    assert len(shards) > 1 and {p for _, _, p in hub.downloads} == set(got["files"])
    assert set(got["files"]) == {"config.json", "generation_config.json", "model.safetensors.index.json"} | shards
    ids = [1, 5, 9, 14, 3]
    config = EngineConfig(model=ModelConfig(model=got["path"], dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=16 << 20, block_size=4), parallel=ParallelConfig(device="cpu"))
    executor = make_executor(config, got["path"], read_arch(got["path"]))
    try:
        ours = executor.score(ids, 0)
    finally:
        executor.shutdown()
    with torch.no_grad():
        ref = LlamaForCausalLM.from_pretrained(hub.sharded_dir, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.float(), ref, rtol=1e-4, atol=1e-4)


REFUSED_IDS = ["acme/a--b", "acme/a..b", "acme/" + "x" * 97, "acme/a..b/f.gguf"]
# LOADER for several sources in one process: huggingface_hub refuses these from the name alone, before any
# request, so one fresh process loads them all (a process per name cost ~0.4 s apiece).
LOADER_EACH = """
import json, sys
from rayllm.loader.model_files import resolve_model_path
out = []
for source in sys.argv[1:]:
    try:
        out.append({"path": resolve_model_path(source, None)})
    except Exception as exc:
        out.append({"error": f"{type(exc).__name__}: {exc}"})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refused_loads(hub, tmp_path_factory) -> dict[str, dict]:
    """LOADER's answer for each of REFUSED_IDS, from one process."""
    return dict(zip(REFUSED_IDS, run(hub, tmp_path_factory.mktemp("refused"), LOADER_EACH, *REFUSED_IDS), strict=True))


@pytest.mark.parametrize("name", REFUSED_IDS)
def test_ids_huggingface_hub_refuses_are_source_errors(refused_loads, name):
    """Names the id pattern lets through but huggingface_hub refuses (HFValidationError, a ValueError): the
    error naming the source, as every other; a client's lora_path naming one is the 404 naming lora_path."""
    from rayllm.loader.adapter_sources import fetch_adapter
    from rayllm.loader.model_sources import ModelSourceError
    from rayllm.serve.lora.lora_registry import source_failure

    got = refused_loads[name]
    assert got["error"].startswith("ModelSourceError") and repr(name) in got["error"], got
    with pytest.raises(ModelSourceError) as failed:  # a replica's fetch of a client's `lora_path: hf://<name>`
        fetch_adapter(name, {"adapter_config.json": 1 << 20}, keep=1)
    err = source_failure("a", failed.value)
    assert err.status_code == 404 and err.param == "lora_path" and name in err.message


ADAPTER = """
import json, os, sys
from rayllm.loader import adapter_sources
limits = {"adapter_config.json": 1 << 20, "adapter_model.safetensors": int(sys.argv[2])}
try:
    path = adapter_sources.fetch_adapter(sys.argv[1], limits, keep=4).path
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
else:
    print(json.dumps({"path": path, "files": sorted(f for f in os.listdir(path) if not f.startswith("."))}))
"""


def test_an_adapter_is_its_two_files_and_a_model_repo_is_refused_before_any_download(hub, tmp_path):
    """Under `hf://acme/` a client may name any repository of the org, a whole model's too: refused from its
    file list (nothing downloaded), as is an adapter over the size limit; an adapter is its two top-level
    files alone, one copy per commit whatever the spelling."""
    files = hub.repos["acme/adapter"]["main"]
    size = len(files["adapter_model.safetensors"])
    cache = {"RAYLLM_MODEL_CACHE": str(tmp_path / "cache")}
    hub.downloads.clear()
    for source, limit in (("acme/tiny-llama", 1 << 30), ("acme/adapter", size - 1)):
        refused = run(hub, tmp_path, ADAPTER, source, str(limit), **cache)
        assert refused["error"].startswith(f"NotAnAdapter: adapter source {source!r}"), refused
    assert hub.downloads == [] and not os.path.exists(tmp_path / "cache")
    got = run(hub, tmp_path, ADAPTER, "acme/adapter", str(size), **cache)
    assert got["files"] == sorted(p for _, _, p in hub.downloads) == ["adapter_config.json", "adapter_model.safetensors"]
    for f in got["files"]:
        assert open(os.path.join(got["path"], f), "rb").read() == files[f]
    hub.downloads.clear()
    sha = hub.commits[("acme/adapter", "main")]
    for spelling in ("acme/adapter", "acme/adapter@main", f"acme/adapter@{sha}"):
        assert run(hub, tmp_path, ADAPTER, spelling, str(size), **cache)["path"] == got["path"]
    assert hub.downloads == []




def test_app_build_fetches_no_weights_and_pins_every_deployment_to_one_commit(hub, tmp_path, gguf_path):
    """The build (on the head) fetches config and tokenizer files only and binds every deployment to the
    commit `main` names then; a tokenizer replica fetches no weights and renders as transformers does; a push
    to `main` after the build changes nothing for the app's replicas."""
    from rayllm.serve.chat_template import load_tokenizer

    hub.downloads.clear()
    sha = hub.commits[("acme/chat-llama", "main")]
    built = run(hub, tmp_path / "head", BUILD, "acme/chat-llama")
    pinned = f"acme/chat-llama@{sha}"
    assert built == {"llm": pinned, "engine": [pinned, None], "tokenizer": {"m": pinned}, "ingress": pinned}
    fetched = {p for _, _, p in hub.downloads}
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not any(p.endswith(".safetensors") for p in fetched), fetched
    hub.downloads.clear()
    tok = run(hub, tmp_path / "node2", TOKENIZER, pinned)
    assert sha in tok["path"] and not any(p.endswith(".safetensors") for _, _, p in hub.downloads)
    ref = load_tokenizer(gguf_path)  # the tokenizer whose files the repository holds
    messages = [{"role": "user", "content": "Hi there"}]
    assert tok["text"] == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok["ids"] == ref.encode(tok["text"], add_special_tokens=False)
    # A push: `main` now names a one-layer model; the old commit stays fetchable by its sha, as on the Hub.
    hub.repos["acme/chat-llama"]["before-push"] = hub.repos["acme/chat-llama"]["main"]
    hub.commits[("acme/chat-llama", "before-push")] = sha
    hub.repos["acme/chat-llama"]["main"] = _llama_files(1) | hub.tokenizer_files
    hub.commits[("acme/chat-llama", "main")] = "f" * 40
    assert _layers(load(hub, tmp_path / "node3", pinned)["path"]) == 2  # a replica started after the push
    assert _layers(load(hub, tmp_path / "node3", "acme/chat-llama")["path"]) == 1


def test_the_build_only_looks_a_gguf_up(hub, tmp_path, gguf_path):
    """A GGUF source's check downloads nothing (its HEAD answers, and names the commit to pin)."""
    name = os.path.basename(gguf_path)
    hub.downloads.clear()
    assert run(hub, tmp_path, CHECK, "acme/one-gguf") == f"acme/one-gguf@{hub.commits[('acme/one-gguf', 'main')]}"
    named = f"acme/smol-gguf/{name}"
    assert run(hub, tmp_path, CHECK, named) == f"{named}@{hub.commits[('acme/smol-gguf', 'main')]}"
    assert hub.downloads == []
    assert "no file 'nope.gguf'" in load(hub, tmp_path, "acme/smol-gguf/nope.gguf")["error"]
