"""rayllm.loader.model_files: a GGUF is a GGUF by its name in any case, to the path resolver and the loader
alike (the resolver took `.GGUF`, the loader then read it as a Hugging Face folder)."""

from __future__ import annotations

import torch

from rayllm.executor.executor import make_executor
from rayllm.loader.loader import count_tensors, read_arch
from rayllm.loader.model_files import resolve_model_path
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig


def _logits(path: str, ids: list[int]) -> torch.Tensor:
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=16 << 20, block_size=4), parallel=ParallelConfig(device="cpu"))
    executor = make_executor(config, path, read_arch(path))
    try:
        return executor.score(ids, 0)
    finally:
        executor.shutdown()


def test_an_uppercase_gguf_loads_as_the_same_file_in_lowercase(gguf_path, tmp_path):
    upper = tmp_path / "SmolLM2.Q4_1.GGUF"
    upper.symlink_to(gguf_path)
    assert resolve_model_path(str(upper)) == str(upper)
    assert read_arch(str(upper)) == read_arch(gguf_path)
    assert count_tensors(str(upper)) == count_tensors(gguf_path) > 0
    ids = [1, 504, 3458, 30, 216]
    torch.testing.assert_close(_logits(str(upper), ids), _logits(gguf_path, ids), rtol=0, atol=0)
