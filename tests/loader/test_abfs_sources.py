"""abfs:// model sources against a real Azure Blob server: Azurite (Microsoft's emulator, from npm; .ci/run
installs it under ~/.cache/rayllm-ci/azurite), started here as its own process and spoken to by adlfs through
fsspec as in production, with the emulator's documented development account in AZURE_STORAGE_CONNECTION_STRING.

The model is a random-weight Llama built with transformers (only the bytes matter), uploaded beside a file a
model does not need. Checked: the first load downloads the needed files and nothing else, byte for byte and
against the store's Content-MD5; the second finds them in the cache; a missing prefix or container is a clear
error naming the source. The cache's crash safety and per-node lock are the same code as for s3://
(test_object_store_sources.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time

import httpx
import pytest

from rayllm.loader import model_sources
from rayllm.loader.object_store import store_md5
from tests.ports import free_port

pytest.importorskip("adlfs", reason="the storage extra (adlfs) is not installed")

AZURITE = shutil.which("azurite-blob") or os.path.expanduser("~/.cache/rayllm-ci/azurite/node_modules/.bin/azurite-blob")
# Azurite's fixed development account (its documentation's, not a secret).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


@pytest.fixture(scope="module")
def azure(tmp_path_factory):
    """{files: {name: sha256}, fs}: Azurite with a model under abfs://models/llama/."""
    assert os.path.exists(AZURITE), "Azurite is missing: npm install azurite (.ci/run does)"
    port = free_port()
    proc = subprocess.Popen([AZURITE, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                             "--skipApiVersionCheck", "--disableTelemetry", "--silent"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(endpoint, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.time() < deadline, "Azurite did not start"
            time.sleep(0.1)
    env = {"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};"
                                              f"AccountKey={KEY};BlobEndpoint={endpoint};",
           "RAYLLM_MODEL_CACHE": str(tmp_path_factory.mktemp("cache"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)  # random weights
    (model_dir / "optimizer.pt").write_bytes(os.urandom(4096))  # not needed: must not be downloaded
    fs = fsspec.filesystem("abfs", skip_instance_cache=True)
    fs.mkdir("models")
    files = {}
    for f in sorted(model_dir.iterdir()):
        fs.pipe_file(f"models/llama/{f.name}", f.read_bytes())
        files[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    yield {"files": files, "fs": fs}
    proc.terminate()
    proc.wait(10)
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_first_load_downloads_the_needed_files_second_uses_the_cache(azure):
    from rayllm.loader.loader import read_arch
    from rayllm.loader.model_files import resolve_model_path

    uri = "abfs://models/llama"
    listing = model_sources._listing(azure["fs"], "models/llama", single=False)
    for info in listing.values():  # the store's MD5 is what the download is checked against
        body = azure["fs"].cat_file(info["name"])
        assert store_md5(azure["fs"], info) == hashlib.md5(body, usedforsecurity=False).hexdigest()
    first = model_sources.fetch(uri)
    assert first.downloaded
    got = {f for f in os.listdir(first.path) if f != model_sources.MANIFEST}
    assert got == set(azure["files"]) - {"optimizer.pt"} and set(listing) == set(azure["files"])  # its top level
    for name in got:
        with open(os.path.join(first.path, name), "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == azure["files"][name]
    assert model_sources.fetch(uri) == model_sources.Fetched(first.path, False)
    path = resolve_model_path(uri)  # the engine's own entry point: the cached directory, which loads
    assert path == first.path and read_arch(path).num_layers == 2


def test_missing_prefix_or_container_is_a_clear_error_naming_the_source(azure):
    from rayllm.loader.model_files import resolve_model_path

    with pytest.raises(model_sources.ModelSourceError, match="abfs://models/no-such-model"):
        resolve_model_path("abfs://models/no-such-model")
    with pytest.raises(model_sources.ModelSourceError, match="abfs://no-such-container/m"):
        resolve_model_path("abfs://no-such-container/m")
