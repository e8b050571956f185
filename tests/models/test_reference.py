"""Our sharded model's logits equal transformers' implementation of the same weights, at TP=1 and TP=2."""

from __future__ import annotations

import pytest
import torch

from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def make_tiny_checkpoint(tmp_path, kind: str) -> str:
    """A tiny random model saved by transformers itself (random weights: this test says so)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=3, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    else:  # Qwen2: q/k/v bias, tied embeddings
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    path = tmp_path / kind
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def our_logits(model_path: str, tp: int, ids: list[int]) -> torch.Tensor:
    config = EngineConfig(
        model=ModelConfig(model=model_path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
    )
    executor = make_executor(config, model_path, read_arch(model_path))
    try:
        return executor.score(ids)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_random_model_matches_transformers(tmp_path, kind, tp, request):
    from transformers import AutoModelForCausalLM

    if tp > 1:
        request.getfixturevalue("ray_local")
    path = make_tiny_checkpoint(tmp_path, kind)
    ids = [int(x) for x in torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(1))]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = our_logits(path, tp, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_smollm2_logits_match_transformers(gguf_path, hf_model, hf_tokenizer, tp, request):
    """The real default model; SmolLM2's 3 KV heads split 2+1 across two ranks."""
    if tp > 1:
        request.getfixturevalue("ray_local")
    ids = hf_tokenizer("The capital of France is Paris. The capital of Germany is", add_special_tokens=False).input_ids
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    got = our_logits(gguf_path, tp, ids)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    assert hf_tokenizer.decode(int(got[-1].argmax())).strip() == "Berlin"


@pytest.mark.parametrize("damage", ["missing", "unexpected", "misshaped"])
def test_loader_fails_loudly_on_bad_checkpoints(tmp_path, damage):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint(tmp_path, "llama")
    (shard,) = [f for f in __import__("os").listdir(path) if f.endswith(".safetensors")]
    tensors = load_file(f"{path}/{shard}")
    if damage == "missing":
        tensors.pop("model.layers.1.mlp.down_proj.weight")
    elif damage == "unexpected":
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    else:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(5, 96)
    save_file(tensors, f"{path}/{shard}")
    with pytest.raises(ValueError, match={"missing": "missing", "unexpected": "unexpected",
                                          "misshaped": "k_proj"}[damage]):
        our_logits(path, 1, [1, 2, 3])
