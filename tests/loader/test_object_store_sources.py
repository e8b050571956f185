"""s3:// model sources against a real S3-compatible server: moto's standalone server (`moto_server`, from
PyPI's moto[server]), started here as its own process, spoken to by s3fs through fsspec as in production.

The model is a random-weight Llama built with transformers (the weights are random: only the bytes matter
here), uploaded with boto3 beside a file a model does not need. Checked: the first load downloads the needed
files and nothing else, byte for byte; the second finds them in the cache; a download killed midway leaves
nothing that looks complete and is redone; two loaders on one node started together download once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from rayllm.loader import model_sources
from tests.ports import free_port

BUCKET = "models"
# Large enough that a download is still running when the test kills it: three of object_store's 32 MiB ranges,
# fetched in parallel. moto's server reads the whole object for each range, so every download of BIG (and the
# fsize test's, which asks for every range) costs it ranges x BIG: 256 MiB were 8 x 256 MiB of copying apiece.
BIG = 96 << 20
# moto's server, with one thing of S3's that moto leaves out: an object stored with SSE-KMS has an ETag that
# is not its MD5 (moto gives every object its MD5 as ETag).
MOTO = """
import hashlib, sys
from moto.s3 import models
from moto.server import main

md5_etag = models.FakeKey.etag
models.FakeKey.etag = property(lambda key: '"%s"' % hashlib.md5(b"kms" + key.name.encode()).hexdigest()
                               if key.encryption == "aws:kms" else md5_etag.fget(key))
main(sys.argv[1:])
"""


@contextlib.contextmanager
def moto_s3(cache: str) -> Iterator[dict[str, str]]:
    """A moto server (MOTO) as this process's S3 (AWS_* pointed at it) and `cache` as its model cache: yields
    that environment (also for subprocesses)."""
    pytest.importorskip("moto.server", reason="moto_server is missing: pip install 'moto[server]' (the test extra)")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", MOTO, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
           "AWS_ENDPOINT_URL": endpoint, "RAYLLM_MODEL_CACHE": cache}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    from s3fs import S3FileSystem

    S3FileSystem.clear_instance_cache()  # fsspec keeps filesystems, each with the endpoint it was made with
    try:
        yield env
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """{endpoint, env, files}: a moto server with a model under s3://models/llama/ and a big GGUF-named blob."""
    with moto_s3(str(tmp_path_factory.mktemp("cache"))) as env:
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
        yield {"endpoint": env["AWS_ENDPOINT_URL"], "env": env, "files": files, "client": client, "dir": model_dir}


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


def _put(s3, prefix: str, files: dict[str, bytes], **put) -> None:
    for name, body in files.items():
        s3["client"].put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=body, **put)


def _model_files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def test_sse_kms_objects_are_checked_by_size_alone(s3):
    """An SSE-KMS object's ETag is not its MD5 (S3's rule, which the server here keeps): checked against it,
    every download from such a bucket failed. An object's HEAD says how it is stored; a plain object's
    ETag is its MD5 and is checked; an S3 Express bucket's never is."""
    _put(s3, "kms", _model_files(s3["dir"]), ServerSideEncryption="aws:kms")
    fetched = model_sources.fetch(f"s3://{BUCKET}/kms")
    assert fetched.downloaded
    for name in set(s3["files"]) - {"optimizer.pt"}:
        assert _sha(os.path.join(fetched.path, name)) == s3["files"][name]
    import fsspec

    from rayllm.loader.object_store import store_md5

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    kms, plain = fs.info(f"{BUCKET}/kms/config.json"), fs.info(f"{BUCKET}/llama/config.json")
    assert kms["ETag"].strip('"') != hashlib.md5(fs.cat_file(kms["name"]), usedforsecurity=False).hexdigest()
    assert store_md5(fs, kms) is None
    assert store_md5(fs, plain) == hashlib.md5(fs.cat_file(plain["name"]), usedforsecurity=False).hexdigest()
    assert store_md5(fs, plain | {"name": "models--use1-az4--x-s3/llama/config.json"}) is None


def test_a_prefix_is_what_its_top_level_files_make_it(s3, tmp_path):
    """One GGUF (any case; a subfolder's do not count) is that GGUF; several are an error before any
    download; a model folder is its config and tokenizer files and the shards its index names (not
    consolidated.safetensors, not a subfolder's); its tokenizer part is those files alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    blob = os.urandom(1 << 20)
    _put(s3, "one", {"Model.Q4_0.GGUF": blob, "README.md": b"# one", "sub/other.gguf": b"GGUF"})
    one = model_sources.fetch(f"s3://{BUCKET}/one")
    assert os.path.basename(one.path) == "Model.Q4_0.GGUF" and _sha(one.path) == hashlib.sha256(blob).hexdigest()
    assert set(os.listdir(os.path.dirname(one.path))) == {"Model.Q4_0.GGUF", model_sources.MANIFEST}

    _put(s3, "two", {"a.Q4_0.gguf": blob, "a.Q8_0.gguf": blob})
    with pytest.raises(model_sources.ModelSourceError, match=r"'s3://models/two' holds 2 GGUF files"):
        model_sources.fetch(f"s3://{BUCKET}/two")
    entry = model_sources._entry_dir(f"s3://{BUCKET}/two")
    assert not os.path.exists(entry) and not os.path.exists(entry + ".partial")

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    files = _model_files(tmp_path)
    shards = set(json.loads(files["model.safetensors.index.json"])["weight_map"].values())
    _put(s3, "sharded", files | {"consolidated.safetensors": files[min(shards)], "tokenizer.json": b"{}",
                                 "original/model.safetensors": b"x", "extra.gguf": b"GGUF"})
    uri = f"s3://{BUCKET}/sharded"
    meta = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"}
    tok = model_sources.fetch(uri, part="tokenizer")
    assert tok.downloaded and set(os.listdir(tok.path)) - {model_sources.MANIFEST} == meta
    whole = model_sources.fetch(uri)
    assert whole.downloaded and whole.path != tok.path
    assert set(os.listdir(whole.path)) - {model_sources.MANIFEST} == meta | shards and len(shards) > 1
    # The whole model serves its tokenizer too.
    assert model_sources.fetch(uri, part="tokenizer") == model_sources.Fetched(whole.path, False)


FAIL = """
import json, resource, signal, sys
from rayllm.loader import model_sources
if sys.argv[2] == "fsize":  # a disk that has no room for the file (EFBIG, as ENOSPC would be)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    model_sources.fetch(sys.argv[1])
except Exception as exc:
    print(json.dumps(f"{type(exc).__name__}: {exc}"))
"""


@pytest.mark.parametrize("failure", ["fsize", "no-credentials"])
def test_a_backends_own_errors_are_source_errors(s3, tmp_path, failure):
    """A disk without room mid-download (an OSError) and botocore's NoCredentialsError (not an OSError):
    each a ModelSourceError naming the source (a client's lora_path: the 404 naming it), not a 500."""
    env = os.environ | {"RAYLLM_MODEL_CACHE": str(tmp_path)}
    if failure == "no-credentials":
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.pop(k)
        env |= {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                "AWS_EC2_METADATA_DISABLED": "true"}
    uri = f"s3://{BUCKET}/big/blob.gguf"
    out = subprocess.run([sys.executable, "-c", FAIL, uri, failure], capture_output=True, text=True, env=env,
                         timeout=120)
    error = json.loads(out.stdout.strip().splitlines()[-1])
    assert error.startswith(f"ModelSourceError: model source {uri!r}: "), error
    assert ("File too large" if failure == "fsize" else "NoCredentialsError") in error


def test_a_loader_waiting_for_another_says_so(s3, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAYLLM_MODEL_CACHE", str(tmp_path))
    uri = f"s3://{BUCKET}/llama"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from filelock import FileLock; "
                               "lock = FileLock(sys.argv[1]); lock.acquire(); print('held', flush=True); time.sleep(1)",
                               model_sources._entry_dir(uri) + ".lock"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with caplog.at_level("INFO", logger="rayllm.loader"):
        fetched = model_sources.fetch(uri)  # the other process ended without downloading: this one does
    assert holder.wait(10) == 0 and fetched.downloaded
    assert any("waiting for another process's download" in r.getMessage() for r in caplog.records)
