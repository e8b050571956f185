"""rayllm/loader/weight_cache.py on the real default model (SmolLM2-135M-Instruct's GGUF, a copy in tmp_path):
a start that reads the cache ends with the same weights and weight methods as the load that wrote it (every
parameter bit-equal, every linear layer's output bit-equal at a small-batch and a large step), and an entry
that is stale (the file or the settings changed), damaged or truncated is not used and leaves the model as it was."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from rayllm.attention.selector import make_attention_backend
from rayllm.executor.worker import Worker, default_dtype
from rayllm.layers.linear import VNNI_TOKENS, TPGroup
from rayllm.layers.linear_method import LinearBase, SmallBatchMethod
from rayllm.loader import weight_cache
from rayllm.loader.loader import read_arch
from rayllm.models.registry import model_class
from rayllm.platforms.select import platform_for
from rayllm.schema.config import EngineConfig, for_device

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("weight_cache")
    model = str(root / "model.gguf")
    shutil.copy(gguf_path, model)  # its own mtime to change (the stale test)
    old = os.environ.get("RAYLLM_WEIGHT_CACHE")
    os.environ["RAYLLM_WEIGHT_CACHE"] = str(root / "cache")
    yield model, root / "cache"
    if old is None:
        os.environ.pop("RAYLLM_WEIGHT_CACHE")
    else:
        os.environ["RAYLLM_WEIGHT_CACHE"] = old


def _config(**cpu) -> EngineConfig:
    config = for_device(EngineConfig(), "cpu")
    if cpu:
        config = replace(config, parallel=replace(config.parallel, cpu=replace(config.parallel.cpu, **cpu)))
    return config


def _entry(model: str, config: EngineConfig | None = None) -> weight_cache.WeightCache:
    config = config or _config()
    platform = platform_for(config, torch.device("cpu"))
    cache = weight_cache.for_worker(config, model, read_arch(model), torch.bfloat16, TPGroup(), platform)
    assert cache is not None
    return cache


def _skeleton(model: str) -> torch.nn.Module:
    arch = read_arch(model)
    with torch.device("cpu"), default_dtype(torch.bfloat16):
        return model_class(arch)(arch, TPGroup(), make_attention_backend("auto", torch.device("cpu")))


@pytest.fixture(scope="module")
def loaded(env):
    """The uncached load that writes the entry, then a start that reads it."""
    model, cache_dir = env
    arch = read_arch(model)
    first = Worker(_config(), model, arch, rank=0, dist_init=None)
    assert len(list(cache_dir.glob("*.safetensors"))) == 1
    second = Worker(_config(), model, arch, rank=0, dist_init=None)
    return first.model, second.model


def test_a_cached_start_equals_the_load_that_wrote_it(env, loaded):
    fresh, cached = loaded
    assert _entry(env[0]).path.is_file()
    a, b = dict(fresh.named_parameters()), dict(cached.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert _same_bits(a[name], b[name]), name
    g = torch.Generator().manual_seed(0)
    layers = [(n, m) for n, m in fresh.named_modules() if isinstance(m, LinearBase)]
    cached_modules = dict(cached.named_modules())
    packed = 0
    for name, m in layers:
        other = cached_modules[name]
        assert type(m.method) is type(other.method), name
        if isinstance(m.method, SmallBatchMethod):
            packed += 1
            small = other.method.small
            assert type(m.method.small.vnni) is type(small.vnni), name
            # In torch's own 64-byte aligned memory as a fresh load's: safetensors' 8-byte aligned offsets made
            # torch's int8 kernel fault on the LM head at 4 rows.
            vnni = getattr(small.vnni, "inner", small.vnni)  # an LM head's Q8_0 planes: one VNNI weight inside
            kept = [vnni.packed] if vnni is not None else [small.packed, small.scales]
            assert all(t.data_ptr() % 64 == 0 for t in kept), name
        for rows in (2, 4, VNNI_TOKENS + 1):  # the small-batch copy, then oneDNN's dense path (beyond every copy)
            x = torch.randn(rows, m.weight.shape[1], generator=g).to(torch.bfloat16)
            assert torch.equal(m.base(x), other.base(x)), (name, rows)
    assert packed > 0  # the default model's 4/8-bit layers have small-batch copies


def test_a_batch_invariant_cached_start_keeps_its_copies_at_every_step(env, loaded):
    """scheduler.batch_invariant: the 4-bit layers' VNNI copies serve every step size (no oneDNN path behind
    them); a start from that entry (its own key) has them so again, with the same outputs at 1 row and past
    the default mode's switch to oneDNN."""
    model, cache_dir = env
    config = replace(_config(), scheduler=replace(_config().scheduler, batch_invariant=True))
    assert _entry(model, config).key != _entry(model).key
    arch = read_arch(model)
    fresh = Worker(config, model, arch, rank=0, dist_init=None).model
    assert _entry(model, config).path.is_file()
    cached = Worker(config, model, arch, rank=0, dist_init=None).model
    cached_modules = dict(cached.named_modules())
    g = torch.Generator().manual_seed(1)
    every_step = 0
    for name, m in fresh.named_modules():
        if not isinstance(m, LinearBase):
            continue
        other = cached_modules[name]
        assert type(m.method) is type(other.method), name
        if isinstance(m.method, SmallBatchMethod):
            assert m.method.every_step and other.method.every_step and m.large_batch_method is None, name
            every_step += 1
            # Its dense weight is never read: released after the entry was written (the tied LM head's is the
            # embedding's, kept).
            tied = name == "lm_head" and arch.tie_word_embeddings
            assert (m.weight.device.type, other.weight.device.type) == (("cpu", "cpu") if tied else ("meta", "meta")), name
        for rows in (1, VNNI_TOKENS + 1):
            x = torch.randn(rows, m.weight.shape[1], generator=g).to(torch.bfloat16)
            assert torch.equal(m.base(x), other.base(x)), (name, rows)
    assert every_step == 4 * arch.num_layers + 1  # every projection and the LM head (all 4/8-bit in this GGUF)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (a skeleton's uninitialized parameters may hold NaNs, which torch.equal calls unequal)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _refused(model_path: str, cache: weight_cache.WeightCache) -> None:
    skeleton = _skeleton(model_path)
    before = _params(skeleton)
    assert not cache.restore(skeleton)
    after = _params(skeleton)
    assert all(_same_bits(before[n], after[n]) for n in before)
    assert all(not isinstance(m.method, SmallBatchMethod) for m in skeleton.modules() if isinstance(m, LinearBase))


def test_other_settings_or_a_changed_file_find_no_entry(env, loaded, monkeypatch):
    model, _ = env
    current = _entry(model)
    assert current.restore(_skeleton(model))  # the entry works for the same inputs
    other = _entry(model, _config(int8_passes=1))
    assert other.key != current.key
    _refused(model, other)
    # Another gguf (its dequantizers make the dense values) or numpy (their arithmetic) than wrote the entry.
    version = importlib.metadata.version
    with monkeypatch.context() as m:
        m.setattr(importlib.metadata, "version", lambda name: "0.0.1" if name == "gguf" else version(name))
        assert _entry(model).key != current.key
    with monkeypatch.context() as m:
        m.setattr(np, "__version__", "0.0.1")
        assert _entry(model).key != current.key
    assert _entry(model).key == current.key
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        changed = _entry(model)
        assert changed.key != current.key
        _refused(model, changed)
    finally:
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_damaged_or_foreign_entry_is_not_used(env, loaded):
    model, _ = env
    cache = _entry(model)
    good = cache.path.read_bytes()
    try:
        damaged = bytearray(good)
        damaged[-1000] ^= 0xFF  # inside the last tensor's data
        cache.path.write_bytes(bytes(damaged))
        _refused(model, cache)
        cache.path.write_bytes(good[: len(good) // 2])  # truncated
        _refused(model, cache)
        cache.path.write_bytes(good)
        foreign = weight_cache.WeightCache(cache.directory, model, "0" * 64)  # the file, named for another key
        shutil.copy(cache.path, foreign.path)
        _refused(model, foreign)
        foreign.path.unlink()
    finally:
        cache.path.write_bytes(good)
    assert cache.restore(_skeleton(model))


def _entries(directory, specs: list[tuple[str, str, int]]) -> list[weight_cache.WeightCache]:
    """Empty entry files (model, key letter, age in seconds), older for larger ages."""
    now = time.time()
    out = []
    for model, key, age in specs:
        cache = weight_cache.WeightCache(directory, model, key * 64)
        cache.path.write_bytes(b"")
        os.utime(cache.path, (now - age, now - age))
        out.append(cache)
    return out


@pytest.mark.parametrize("per_model", [None, "2"])
def test_eviction_keeps_the_newest_entries_per_model_and_in_all(tmp_path, monkeypatch, per_model):
    if per_model is None:
        monkeypatch.delenv("RAYLLM_WEIGHT_CACHE_ENTRIES", raising=False)
    else:
        monkeypatch.setenv("RAYLLM_WEIGHT_CACHE_ENTRIES", per_model)
    keep = int(per_model or 1)
    a_old, a_mid = _entries(tmp_path, [("/m/a.gguf", "a", 5), ("/m/a.gguf", "b", 3)])
    others = _entries(tmp_path, [(f"/m/o{i}.gguf", "c", 10 + i) for i in range(4 * keep + 2)])
    written = weight_cache.WeightCache(tmp_path, "/m/a.gguf", "d" * 64)  # the entry a start just wrote
    written.path.write_bytes(b"")
    written._evict()
    left = set(tmp_path.glob("*.safetensors"))
    mine = [c.path for c in (written, a_mid, a_old)]
    assert [p in left for p in mine] == [i < keep for i in range(3)]  # the newest of this model
    assert len(left) == weight_cache.KEEP * keep  # and the newest in all
    assert {c.path for c in others} & left == {c.path for c in others[: len(left) - keep]}
