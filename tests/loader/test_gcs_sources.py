"""gs:// model sources against a real GCS-compatible server: gcp-storage-emulator (PyPI), started here as its own
process and spoken to by gcsfs through fsspec as in production (STORAGE_EMULATOR_HOST is gcsfs's own switch
to an emulator). The emulator has no gRPC control API, so gcsfs's bucket-type probe is turned off
(GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false); with it on, each new bucket costs a 60 s timeout there.

The model is a random-weight Llama built with transformers (only the bytes matter), uploaded beside a file a
model does not need. Checked: the first load downloads the needed files and nothing else, byte for byte and
against the store's MD5 (GCS's md5Hash); the second finds them in the cache; a missing prefix or bucket is a
clear error naming the source. The cache's crash safety and per-node lock are the same code as for s3://
(test_object_store_sources.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import time

import httpx
import pytest

from rayllm.loader import model_sources
from rayllm.loader.object_store import store_md5
from tests.ports import free_port

# Not imported here: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when first imported (in the fixture).
if importlib.util.find_spec("gcsfs") is None:
    pytest.skip("the storage extra (gcsfs) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """{files: {name: sha256}}: an emulator with a model under gs://models/llama/."""
    pytest.importorskip("gcp_storage_emulator", reason="pip install gcp-storage-emulator (the test extra)")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gcp_storage_emulator", "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(endpoint, timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.time() < deadline, "gcp-storage-emulator did not start"
            time.sleep(0.1)
    env = {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
           "RAYLLM_MODEL_CACHE": str(tmp_path_factory.mktemp("cache"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    # No Google credentials here: anonymous, as FSSPEC_GS_TOKEN=anon would say had fsspec not been imported yet.
    fsspec.config.conf.setdefault("gs", {})["token"] = "anon"
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)  # random weights
    (model_dir / "optimizer.pt").write_bytes(os.urandom(4096))  # not needed: must not be downloaded
    fs = fsspec.filesystem("gs", skip_instance_cache=True)
    fs.mkdir("models")
    files = {}
    for f in sorted(model_dir.iterdir()):
        fs.put_file(str(f), f"models/llama/{f.name}")
        files[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    yield {"files": files, "fs": fs}
    proc.terminate()
    proc.wait(10)
    fsspec.config.conf["gs"].pop("token", None)
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_first_load_downloads_the_needed_files_second_uses_the_cache(gcs):
    from rayllm.loader.loader import read_arch
    from rayllm.loader.model_files import resolve_model_path

    uri = "gs://models/llama"
    listing = model_sources._listing(gcs["fs"], "models/llama", single=False)
    for info in listing.values():  # the store's MD5 is what the download is checked against
        body = gcs["fs"].cat_file(info["name"])
        assert store_md5(gcs["fs"], info) == hashlib.md5(body, usedforsecurity=False).hexdigest()
    first = model_sources.fetch(uri)
    assert first.downloaded
    got = {f for f in os.listdir(first.path) if f != model_sources.MANIFEST}
    assert got == set(gcs["files"]) - {"optimizer.pt"} and set(listing) == set(gcs["files"])  # its top level
    for name in got:
        with open(os.path.join(first.path, name), "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == gcs["files"][name]
    assert model_sources.fetch(uri) == model_sources.Fetched(first.path, False)
    path = resolve_model_path(uri)  # the engine's own entry point: the cached directory, which loads
    assert path == first.path and read_arch(path).num_layers == 2


def test_missing_prefix_or_bucket_is_a_clear_error_naming_the_source(gcs):
    from rayllm.loader.model_files import resolve_model_path

    with pytest.raises(model_sources.ModelSourceError, match="gs://models/no-such-model"):
        resolve_model_path("gs://models/no-such-model")
    with pytest.raises(model_sources.ModelSourceError, match="gs://no-such-bucket/m"):
        resolve_model_path("gs://no-such-bucket/m")
