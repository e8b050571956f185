"""s3:// model sources against a real S3-compatible server: moto's standalone server (`moto_server`, from
PyPI's moto[server]), started here as its own process, spoken to by s3fs through fsspec as in production.

The model is a random-weight Llama built with transformers (the weights are random: only the bytes matter
here), uploaded with boto3 beside a file a model does not need. Checked: the first load downloads the needed
files and nothing else, byte for byte; the second finds them in the cache; a download killed midway leaves
nothing that looks complete and is redone; two loaders on one node started together download once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from rayllm.loader import model_sources
from tests.ports import free_port

BUCKET = "models"
BIG = 256 << 20  # large enough that a download is still running when the test kills it


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """{endpoint, env, files}: a moto server with a model under s3://models/llama/ and a big GGUF-named blob."""
    moto = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    assert moto, "moto_server is missing: pip install 'moto[server]' (the test extra)"
    port = free_port()
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(endpoint, timeout=1)
            break
        except httpx.HTTPError:
            assert time.time() < deadline, "moto_server did not start"
            time.sleep(0.1)
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "RAYLLM_MODEL_CACHE": str(tmp_path_factory.mktemp("cache"))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import boto3
    from transformers import LlamaConfig, LlamaForCausalLM

    model_dir = tmp_path_factory.mktemp("llama")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)  # random weights
    (model_dir / "optimizer.pt").write_bytes(os.urandom(4096))  # not needed: must not be downloaded
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    files = {}
    for f in sorted(model_dir.iterdir()):
        client.upload_file(str(f), BUCKET, f"llama/{f.name}")
        files[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    client.put_object(Bucket=BUCKET, Key="big/blob.gguf", Body=os.urandom(BIG))
    yield {"endpoint": endpoint, "env": env, "files": files, "client": client}
    proc.terminate()
    proc.wait(10)
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


LOADER = ("import json, sys; from rayllm.loader import model_sources as m; f = m.fetch(sys.argv[1]); "
          "print(json.dumps({'path': f.path, 'downloaded': f.downloaded}))")


def _loader(uri: str) -> subprocess.Popen:
    """A loader in its own process (as a replica is)."""
    return subprocess.Popen([sys.executable, "-c", LOADER, uri], stdout=subprocess.PIPE, text=True,
                            env=os.environ.copy())


def test_first_load_downloads_the_needed_files_second_uses_the_cache(s3):
    from rayllm.loader.loader import read_arch
    from rayllm.loader.model_files import resolve_model_path

    uri = f"s3://{BUCKET}/llama"
    first = model_sources.fetch(uri)
    assert first.downloaded
    got = {f for f in os.listdir(first.path) if f != model_sources.MANIFEST}
    assert got == set(s3["files"]) - {"optimizer.pt"}
    for name in got:
        assert _sha(os.path.join(first.path, name)) == s3["files"][name]
    second = model_sources.fetch(uri)
    assert second == model_sources.Fetched(first.path, False)
    # The engine's own entry point takes the URI and gets the cached directory, which loads.
    path = resolve_model_path(uri)
    assert path == first.path and read_arch(path).num_layers == 2


def test_interrupted_download_is_redone(s3):
    uri = f"s3://{BUCKET}/big/blob.gguf"
    entry = model_sources._entry_dir(uri)
    child = _loader(uri)
    deadline = time.time() + 60
    while not os.path.isdir(entry + ".partial"):  # the download has begun
        assert child.poll() is None and time.time() < deadline, "the loader ended before it began downloading"
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
    assert child.wait(10) == -signal.SIGKILL
    assert not os.path.exists(entry), "a crashed download looks complete"
    fetched = model_sources.fetch(uri)
    assert fetched.downloaded and os.path.getsize(fetched.path) == BIG
    body = s3["client"].get_object(Bucket=BUCKET, Key="big/blob.gguf")["Body"].read()
    assert _sha(fetched.path) == hashlib.sha256(body).hexdigest()
    assert not os.path.exists(entry + ".partial")


def test_two_loaders_on_one_node_download_once(s3):
    s3["client"].copy_object(Bucket=BUCKET, Key="twice/blob.gguf", CopySource={"Bucket": BUCKET, "Key": "big/blob.gguf"})
    uri = f"s3://{BUCKET}/twice/blob.gguf"
    loaders = [_loader(uri) for _ in range(2)]
    results = [json.loads(p.communicate(timeout=120)[0]) for p in loaders]
    assert all(p.returncode == 0 for p in loaders)
    assert sorted(r["downloaded"] for r in results) == [False, True]
    assert results[0]["path"] == results[1]["path"] and os.path.getsize(results[0]["path"]) == BIG


def test_missing_object_is_a_clear_error_naming_the_source(s3):
    from rayllm.loader.model_files import resolve_model_path

    uri = f"s3://{BUCKET}/no-such-model"
    with pytest.raises(model_sources.ModelSourceError, match="s3://models/no-such-model"):
        resolve_model_path(uri)
    with pytest.raises(model_sources.ModelSourceError, match="s3://no-such-bucket/m"):
        resolve_model_path("s3://no-such-bucket/m")


def test_lora_adapter_from_s3_under_an_allowed_root_and_a_bad_uri(s3, tmp_path, gguf_path):
    """A PEFT adapter (random weights) in the bucket: a client may name it only under an s3:// root of
    lora.allowed_roots; the replica's registry fetches it into the cache and reads it; a missing one is a
    404 naming it, one outside the roots the uniform 400."""
    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter, read_peft_adapter
    from rayllm.protocol.errors import APIError
    from rayllm.schema.config import LoRAConfig
    from rayllm.serve.lora.adapter_paths import REFUSED, resolve_allowed
    from rayllm.serve.lora.lora_registry import LoRARegistry

    arch = read_arch(gguf_path)
    local = random_peft_adapter(str(tmp_path / "a"), arch, rank=4, seed=3)
    for f in os.listdir(local):
        s3["client"].upload_file(os.path.join(local, f), BUCKET, f"adapters/a/{f}")
    roots = ("s3://models/adapters/",)
    assert resolve_allowed("s3://models/adapters/a", roots) == "s3://models/adapters/a"
    for outside in ("s3://models/llama", "s3://models/adapters/../llama", "s3://models/adaptersX/a"):
        with pytest.raises(APIError, match=REFUSED):
            resolve_allowed(outside, roots)
    registry = LoRARegistry(LoRAConfig(max_loras=1, allowed_roots=roots), engine=None)  # only its file side
    assert registry.check_path("s3://models/adapters/a") == "s3://models/adapters/a"
    fetched = registry._local("a", "s3://models/adapters/a")
    assert read_peft_adapter(fetched, arch, 16).rank == read_peft_adapter(local, arch, 16).rank == 4
    for f in os.listdir(local):
        assert _sha(os.path.join(fetched, f)) == _sha(os.path.join(local, f))
    with pytest.raises(APIError) as err:
        registry._local("b", "s3://models/adapters/b")
    assert err.value.status_code == 404 and "s3://models/adapters/b" in err.value.message
