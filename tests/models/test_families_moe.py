"""Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE against transformers' own implementations.

Every model here is a tiny random one built by transformers in the test (tests/tiny_families.py):
the weights are random, so the checks are that our engine computes what transformers computes --
logits at TP=1 and TP=2, greedy generation with prefix caching and chunked prefill, the same
weights read back from a GGUF written as llama.cpp's converter writes it, and attention LoRA.
"""

from __future__ import annotations

import pytest
import torch
from tiny_families import FAMILIES, make_checkpoint, write_gguf

from rayllm.engine.engine import LLMEngine
from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.schema.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

VOCAB = 256


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {family: make_checkpoint(root / family, family) for family in FAMILIES}


def random_ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


def reference_logits(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits(path: str, ids: list[int], tp: int = 1, lora: tuple[str, ...] = ()) -> torch.Tensor:
    config = EngineConfig(
        model=ModelConfig(model=path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=16 << 20),
        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
        lora=LoRAConfig(max_loras=len(lora), max_lora_rank=8),
    )
    executor = make_executor(config, path, read_arch(path))
    try:
        for slot, adapter in enumerate(lora, start=1):
            executor.load_lora(slot, 100 + slot, adapter)
        return executor.score(ids, 101 if lora else 0)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(checkpoints, family, tp, request):
    """TP=2 splits the KV heads 1+1 and every expert's intermediate dim in halves."""
    if tp > 1:
        request.getfixturevalue("ray_local")
    ids = random_ids(40, seed=1)
    expected = reference_logits(checkpoints[family], ids)
    torch.testing.assert_close(our_logits(checkpoints[family], ids, tp), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_gives_the_safetensors_logits(checkpoints, family, tmp_path):
    path = checkpoints[family]
    if family == "qwen3_moe":  # llama.cpp makes every qwen3moe layer sparse: no dense layer in its GGUF
        path = make_checkpoint(tmp_path / "all_sparse", family, mlp_only_layers=[])
    gguf = write_gguf(path, str(tmp_path / f"{family}.gguf"))
    arch = read_arch(gguf)
    assert arch.model_type == {"qwen3": "qwen3", "mixtral": "mixtral", "qwen2_moe": "qwen2moe",
                               "qwen3_moe": "qwen3moe"}[family]
    ids = random_ids(33, seed=2)
    torch.testing.assert_close(our_logits(gguf, ids), our_logits(path, ids), atol=1e-5, rtol=1e-5)


def test_llama_cpp_has_no_name_for_a_dense_qwen3moe_layer(checkpoints, tmp_path):
    """Why the GGUF check above uses an all-sparse Qwen3-MoE: gguf-py maps no dense FFN for qwen3moe."""
    with pytest.raises(ValueError, match="no GGUF name for model.layers.1.mlp"):
        write_gguf(checkpoints["qwen3_moe"], str(tmp_path / "dense.gguf"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_engine_output_equals_generate(checkpoints, family):
    """A batch of prompts of different lengths sharing a prefix, prefilled in chunks of at most 24
    tokens per step, run twice (the second time from the prefix cache), against generate alone."""
    from transformers import AutoModelForCausalLM

    path = checkpoints[family]
    shared = random_ids(37, seed=3)
    prompts = [shared + random_ids(n, seed=10 + n) for n in (1, 9, 20)] + [random_ids(5, seed=4), random_ids(50, seed=5)]
    max_tokens = 10
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # as ignore_eos: the full max_tokens, no EOS suppression either
    expected = []
    for ids in prompts:
        with torch.no_grad():
            # An explicit mask: generate would otherwise mask prompt tokens equal to the pad id.
            x = torch.tensor([ids])
            out = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                               pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=16 << 20, block_size=16, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
        parallel=ParallelConfig(device="cpu"),
    ))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        first = engine.generate(prompts, params)
        hits_first = engine.block_manager.prefix_hits
        second = engine.generate(prompts, params)
        hits_second = engine.block_manager.prefix_hits - hits_first
    finally:
        engine.shutdown()
    assert first == expected
    assert second == expected
    assert hits_first > 0 and hits_second > hits_first  # the shared prefix, then whole prompts, from the cache


def peft_attention_adapter(base: str, out: str):
    """A peft LoRA on q/k/v/o of the base, random A and B (peft zeroes B), saved by peft itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "qwen3_moe"])
def test_attention_lora_matches_peft(checkpoints, family, tmp_path):
    adapter = str(tmp_path / "adapter")
    ref = peft_attention_adapter(checkpoints[family], adapter)
    ids = random_ids(24, seed=6)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        with ref.disable_adapter():
            base = ref(torch.tensor([ids])).logits[0]
    assert (expected - base).abs().max() > 0.1  # the adapter really changes the output
    got = our_logits(checkpoints[family], ids, lora=(adapter,))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key", [
    "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight",  # a routed expert
    "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight",  # an MLP target on a sparse layer
])
def test_expert_lora_is_refused_with_a_clear_error(checkpoints, key, tmp_path):
    import json

    from safetensors.torch import save_file

    from rayllm.lora.files import LoRAError, read_peft_adapter

    path = tmp_path / "experts_adapter"
    path.mkdir()
    save_file({key: torch.zeros(4, 64), key.replace("lora_A", "lora_B"): torch.zeros(32, 4)},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    with pytest.raises(LoRAError, match="mixture-of-experts MLPs .* not supported; target the attention"):
        read_peft_adapter(str(path), read_arch(checkpoints["qwen3_moe"]), max_rank=8)
