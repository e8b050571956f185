"""Adding an attention backend or a model family is a file plus one registry line: a test-only backend and a
test-only family (tests/extension_points.py) run through the real engine and match transformers' logits.

The model is tiny with RANDOM weights (transformers' own initialisation, seeded), saved by save_pretrained."""

from __future__ import annotations

import json
import os

import extension_points
import pytest
import torch

from rayllm.attention.registry import BACKENDS
from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.models.registry import MODEL_CLASSES
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny_llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _score(path: str, backend: str, ids: list[int]) -> torch.Tensor:
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"), cache=CacheConfig(kv_cache_bytes=8 << 20,
                          block_size=4), parallel=ParallelConfig(device="cpu", attention_backend=backend))
    executor = make_executor(config, path, read_arch(path))
    try:
        return executor.score(ids, 0)
    finally:
        executor.shutdown()


def _reference(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


IDS = [int(x) for x in torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(1))]


def test_a_backend_is_a_file_and_one_registry_line(tiny_llama, monkeypatch):
    monkeypatch.setitem(BACKENDS, "counting", "extension_points:CountingAttention")
    extension_points.CountingAttention.calls = 0
    got = _score(tiny_llama, "counting", IDS)
    assert extension_points.CountingAttention.calls > 0  # the engine really ran the test-only backend
    torch.testing.assert_close(got, _reference(tiny_llama, IDS), atol=1e-4, rtol=1e-4)


def test_a_family_is_a_file_and_one_registry_line(tiny_llama, tmp_path, monkeypatch):
    family = tmp_path / "family"
    family.mkdir()
    for name in os.listdir(tiny_llama):
        os.symlink(os.path.join(tiny_llama, name), family / name)
    cfg = json.loads(open(os.path.join(tiny_llama, "config.json")).read())
    (family / "config.json").unlink()
    (family / "config.json").write_text(json.dumps({**cfg, "model_type": "tiny_test_family"}))
    with pytest.raises(ValueError, match="unsupported model architecture 'tiny_test_family'"):
        read_arch(str(family))
    monkeypatch.setitem(MODEL_CLASSES, "tiny_test_family", "extension_points:TinyTestFamily")
    extension_points.TinyTestFamily.built = 0
    got = _score(str(family), "sdpa", IDS)
    assert extension_points.TinyTestFamily.built == 1
    torch.testing.assert_close(got, _reference(tiny_llama, IDS), atol=1e-4, rtol=1e-4)
