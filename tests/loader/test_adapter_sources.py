"""LoRA adapters a client names by an s3:// `lora_path`, against moto's S3 server (test_object_store_sources.py's
moto_s3), fetched by a replica's own LoRARegistry into a real engine (a tiny random-weight Llama saved by
transformers, on a thread of this process).

Checked: every spelling of one prefix is one adapter, one download and one copy, and the root itself is
refused; a prefix that is no adapter (a whole model, a safetensors over what the model's shapes at
max_lora_rank allow, a .bin) is the uniform 400 before anything is downloaded; only the two adapter files
are fetched; the node keeps a bounded number of copies, least recently used removed, held ones kept; a
download holds up no other adapter's load, and concurrent loads of one new source download it once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import pytest

from rayllm.loader import adapter_sources, model_sources
from rayllm.protocol.errors import APIError
from rayllm.serve.lora.adapter_paths import REFUSED
from tests.loader.test_object_store_sources import moto_s3

BUCKET = "loras"
ROOT = f"s3://{BUCKET}/adapters"
BASE = "tiny"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """{base, client, files, local}: a tiny Llama, and under ROOT adapters a..e for it (beside files that are
    no part of an adapter), a whole model, an adapter too large for it, one saved as .bin."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rayllm.loader.loader import read_arch
    from rayllm.lora.files import random_peft_adapter

    with moto_s3(str(tmp_path_factory.mktemp("cache"))):
        import boto3

        base = tmp_path_factory.mktemp("base")
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        LlamaForCausalLM(cfg).save_pretrained(base, safe_serialization=True)  # random weights
        arch = read_arch(str(base))
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)

        def put(prefix: str, files: dict[str, bytes]) -> None:
            for name, body in files.items():
                client.put_object(Bucket=BUCKET, Key=f"adapters/{prefix}/{name}", Body=body)

        local = tmp_path_factory.mktemp("local")
        files = {}
        for seed, name in enumerate("abcde"):
            folder = random_peft_adapter(str(local / name), arch, rank=4, seed=seed, targets=("q_proj", "v_proj"))
            files[name] = {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}
            put(name, files[name])
        put("a", {"README.md": b"# a", "extra.safetensors": files["b"]["adapter_model.safetensors"],
                  "sub/adapter_model.safetensors": b"x"})
        put("model", {f.name: f.read_bytes() for f in base.iterdir()})  # a base model's files
        # Rank 16 on every module is the most max_lora_rank 16 allows (128 KB of tensors here): 512 is 4 MB.
        huge = random_peft_adapter(str(local / "huge"), arch, rank=512, seed=9)
        put("huge", {f: open(os.path.join(huge, f), "rb").read() for f in os.listdir(huge)})
        put("bin", {"adapter_config.json": files["a"]["adapter_config.json"], "adapter_model.bin": b"\x80pickle"})
        yield {"base": str(base), "client": client, "files": files, "local": str(local)}


@pytest.fixture
async def registry(store):
    """A replica's registry (one slot) over the real engine; clients may name adapters under ROOT and `local`."""
    from rayllm.engine.client.engine_client import make_engine_client
    from rayllm.schema.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
    from rayllm.serve.lora.lora_registry import LoRARegistry

    config = EngineConfig(model=ModelConfig(model=store["base"], dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=8 << 20),
                          lora=LoRAConfig(max_loras=1, max_lora_rank=16, allowed_roots=(ROOT + "/", store["local"])))
    client = make_engine_client(config)
    try:
        yield LoRARegistry(config.lora, client)
    finally:
        client.shutdown()


def copies() -> dict[str, set[str]]:
    """The node's adapter copies: {source: their files} (half-done ones under their own name)."""
    folder = os.path.join(model_sources.cache_root(), adapter_sources.ADAPTERS)
    found = {}
    for entry in os.listdir(folder) if os.path.isdir(folder) else ():
        path = os.path.join(folder, entry)
        if os.path.isdir(path):
            manifest = os.path.join(path, model_sources.MANIFEST)
            source = json.load(open(manifest))["source"] if os.path.exists(manifest) else entry
            found[source] = set(os.listdir(path)) - {model_sources.MANIFEST}
    return found


@pytest.fixture(autouse=True)
def empty_cache(store):
    import shutil

    shutil.rmtree(os.path.join(model_sources.cache_root(), adapter_sources.ADAPTERS), ignore_errors=True)


def downloads(caplog) -> list[str]:
    """The sources downloaded while caplog listened (model_sources._cached logs each download as it begins)."""
    return [r.args[0] for r in caplog.records if r.msg.startswith("model source %s: downloading")]


async def test_every_spelling_of_a_prefix_is_one_adapter_one_download_and_the_root_is_refused(registry, store,
                                                                                               caplog):
    """fsspec reads `a`, `a/`, `a//` as one prefix (and `adapters//` as the root, listing every adapter): each
    spelling was a cache entry and a download of its own, and the root's spellings passed the root check."""
    import fsspec

    from rayllm.serve.lora.adapter_table import AdapterTable

    spellings = [f"{ROOT}/a", f"{ROOT}/a/", f"{ROOT}/a//", f"{ROOT}/a///"]
    assert len({fsspec.core.url_to_fs(s)[1] for s in spellings}) == 1
    assert fsspec.core.url_to_fs(f"{ROOT}//")[1] == fsspec.core.url_to_fs(ROOT)[1]
    table = AdapterTable(BASE, {}, created=1, allowed_roots=registry.config.allowed_roots)
    with caplog.at_level("INFO", logger="rayllm.loader"):
        for spelling in spellings:
            name, path = table.resolve(BASE, spelling)  # the ingress: the adapter's name is its canonical path
            assert name == path == f"{ROOT}/a"
            entry = await registry.load(name, path)
            assert entry.name == f"{ROOT}/a" and registry.names() == [entry.name]
    assert downloads(caplog) == [f"{ROOT}/a"]
    # Only the adapter's two files, byte for byte (no README, no other safetensors, nothing of a subfolder).
    assert copies() == {f"{ROOT}/a": {"adapter_config.json", "adapter_model.safetensors"}}
    local = registry._fetched[f"{ROOT}/a"]
    for f, body in store["files"]["a"].items():
        assert open(os.path.join(local, f), "rb").read() == body
    bodies = set()
    for refused in (f"{ROOT}//", f"{ROOT}/", ROOT, f"{ROOT}///", f"{ROOT}//a", f"{ROOT}/./a", f"{ROOT}/a/.",
                    f"{ROOT}/a/../b", f"{ROOT}/a?versionId=1", f"s3://{BUCKET}/adaptersX/a", "/etc"):
        with pytest.raises(APIError) as err:  # the ingress
            table.resolve(BASE, refused)
        bodies.add(repr(err.value.to_dict()))
        with pytest.raises(APIError) as err:  # the replica (the load route's path reaches it as sent)
            await registry.load(refused, refused)
        bodies.add(repr(err.value.to_dict()))
        assert (err.value.status_code, err.value.param, err.value.message) == (400, "lora_path", REFUSED)
    assert len(bodies) == 1  # one body, whatever the reason
    assert registry.names() == [f"{ROOT}/a"] and len(copies()) == 1


@pytest.mark.parametrize("prefix", ["model", "huge", "bin", "a/adapter_config.json"])
async def test_what_is_no_adapter_is_refused_before_anything_is_downloaded(registry, prefix, caplog):
    """A whole model (a 70B in production), an adapter larger than rank 16 on this model can be, a .bin, an
    object rather than a prefix: the uniform 400 (the reason in the replica's log), and nothing on disk."""
    with caplog.at_level("INFO"):
        with pytest.raises(APIError) as err:
            await registry.load(f"{ROOT}/{prefix}", f"{ROOT}/{prefix}")
    assert (err.value.status_code, err.value.param, err.value.message) == (400, "lora_path", REFUSED)
    assert downloads(caplog) == [] and copies() == {}
    assert any(r.levelname == "WARNING" and f"{ROOT}/{prefix}" in r.getMessage() for r in caplog.records)
    with pytest.raises(APIError) as err:  # one that is not there: the 404 naming it, as before
        await registry.load(f"{ROOT}/nothing", f"{ROOT}/nothing")
    assert (err.value.status_code, err.value.code) == (404, "lora_adapter_not_found")
    assert f"{ROOT}/nothing" in err.value.message


async def test_the_node_keeps_the_most_recently_used_copies_but_never_one_being_loaded(registry, store):
    """One slot, so max_loras + IDLE_COPIES = 3 copies are kept: loading a..e leaves c, d, e on disk and in the
    registry's memory; a copy a loader holds is not removed; a removed one is fetched again when needed."""
    from rayllm.serve.lora.lora_registry import IDLE_COPIES

    assert registry.keep == 1 + IDLE_COPIES == 3
    for name in "ab":
        await registry.load(f"{ROOT}/{name}", f"{ROOT}/{name}")
    held = adapter_sources.hold_adapter(registry._fetched[f"{ROOT}/a"])  # as a replica's load of `a` would
    assert held is not None
    with held:
        for name in "cde":
            await registry.load(f"{ROOT}/{name}", f"{ROOT}/{name}")
        assert set(copies()) == {f"{ROOT}/{n}" for n in "acde"}  # b went; a stays while held
    adapter_sources.prune_adapters(registry.keep)
    assert set(copies()) == {f"{ROOT}/{n}" for n in "cde"}
    assert list(registry._fetched) == [f"{ROOT}/{n}" for n in "cde"]
    entry = await registry.load(f"{ROOT}/a", f"{ROOT}/a")  # fetched again
    assert registry.names() == [entry.name] and f"{ROOT}/a" in copies() and len(copies()) == 3


async def test_a_download_holds_up_no_other_load_and_concurrent_loads_of_it_download_once(registry, store, caplog):
    """Another process of the node holds the download lock of `b` (its download never ends meanwhile): a local
    adapter still loads, and two requests for `b` wait for one download, made once the lock is free."""
    from filelock import FileLock

    uri = f"{ROOT}/b"
    lock = FileLock(model_sources._entry_dir(uri, adapter_sources.ADAPTERS) + ".lock")
    lock.acquire()
    try:
        with caplog.at_level("INFO", logger="rayllm.loader"):
            both = asyncio.gather(registry.load(uri, uri), registry.load(uri, uri))
            await asyncio.sleep(0.5)
            local = os.path.join(store["local"], "c")
            entry = await asyncio.wait_for(registry.load(local, local), 30)
            assert registry.names() == [entry.name] and not both.done()
            lock.release()
            first, second = await asyncio.wait_for(both, 60)
    finally:
        if lock.is_locked:
            lock.release()
    assert first is second and registry.names() == [uri]
    assert downloads(caplog) == [uri] and list(copies()) == [uri]
    # One fetch waited for the other process's lock: the second request joined it rather than fetch too.
    assert sum(r.msg.endswith("waiting for another process's download of %s") for r in caplog.records) == 1
    body = store["files"]["b"]["adapter_model.safetensors"]
    with open(os.path.join(registry._fetched[uri], "adapter_model.safetensors"), "rb") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(body).digest()
