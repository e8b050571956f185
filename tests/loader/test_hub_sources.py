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


def _llama_files(layers: int) -> dict[str, bytes]:
    """config.json and model.safetensors of a random-weight Llama with `layers` layers."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)  # random weights
        return {f: open(os.path.join(d, f), "rb").read() for f in os.listdir(d)}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, gguf_path):
    extra = {"README.md": b"# tiny", "pytorch_model.bin": b"\0" * 1024, "original/consolidated.00.pth": b"x"}
    gguf = open(gguf_path, "rb").read()
    server = HubServer(
        {"acme/tiny-llama": {"main": _llama_files(2) | extra, "v1": _llama_files(1) | extra},
         "acme/smol-gguf": {"main": {os.path.basename(gguf_path): gguf, "other.Q8_0.gguf": b"GGUF" + b"\0" * 64,
                                     "README.md": b"# gguf"}},
         "acme/private": {"main": _llama_files(1)}},
        private={"acme/private": TOKEN})
    yield server
    server.close()


def load(hub: HubServer, home, source: str, revision: str = "", **env) -> dict:
    run_env = os.environ.copy()
    for k in ("HF_TOKEN", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        run_env.pop(k, None)
    run_env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"} | env
    out = subprocess.run([sys.executable, "-c", LOADER, source, revision], capture_output=True, text=True,
                         env=run_env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    # A repo of several GGUFs named without the file: a start-up error that says to name one.
    many = load(hub, tmp_path, "acme/smol-gguf")
    assert "2 GGUF files" in many["error"] and "acme/smol-gguf" in many["error"]


