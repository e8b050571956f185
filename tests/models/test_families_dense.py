"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers' own implementations of the same weights
(and, with a random LoRA adapter, against PEFT's).

Every model here is tiny and has RANDOM weights, built by transformers in the test (AutoConfig.for_model,
from_config, save_pretrained); the GGUFs are written from those same weights with the gguf package's
writer, under the tensor names and metadata llama.cpp's convert_hf_to_gguf.py uses for each
architecture. The configs make every family feature matter: sliding windows shorter than the
prompts, soft-capping, a query scale other than the head dim's, linear and LongRoPE scaling, partial
rotary, random (1 + w) norms. Phi-3's window covers every layer, so the greedy test also runs with
the blocks behind the window freed (block_manager.py); Gemma's global layers keep every block.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.lora.files import TARGETS, random_peft_adapter
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
FAMILIES = ["gemma2", "gemma3", "phi3"]
PHI3_ROPE_DIMS = 8  # head_dim 16 with partial_rotary_factor 0.5
PHI3_ORIGINAL_CTX = 32


def _config(family: str):
    from transformers import AutoConfig

    if family == "phi3":
        return AutoConfig.for_model(
            "phi3", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
            original_max_position_embeddings=PHI3_ORIGINAL_CTX, sliding_window=12, pad_token_id=0,
            eos_token_id=1, bos_token_id=2,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "original_max_position_embeddings": PHI3_ORIGINAL_CTX,
                             "short_factor": [1.0 + 0.1 * i for i in range(PHI3_ROPE_DIMS // 2)],
                             "long_factor": [2.0 + 0.5 * i for i in range(PHI3_ROPE_DIMS // 2)]})
    # head_dim 32 is not hidden / heads (16); query_pre_attn_scalar = head_dim, as llama.cpp assumes
    # for GGUFs of all but the 27B models.
    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  vocab_size=VOCAB, max_position_embeddings=256, sliding_window=8, query_pre_attn_scalar=32,
                  rms_norm_eps=1e-6)
    if family == "gemma2":  # layers alternate sliding / global
        return AutoConfig.for_model("gemma2", **common, num_hidden_layers=4, attn_logit_softcapping=20.0,
                                    final_logit_softcapping=5.0)
    # Gemma 3: llama.cpp's fixed pattern (five sliding layers, then a global one); linear scaling on
    # the global rope only, as the 4B+ checkpoints.
    return AutoConfig.for_model(
        "gemma3_text", **common, num_hidden_layers=6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """family -> directory of a tiny random model saved by transformers."""
    from transformers import AutoModelForCausalLM

    out = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family))
        with torch.no_grad():  # random norm weights, so that Gemma's (1 + w) is exercised
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0, 0.3)
        path = tmp_path_factory.mktemp(family)
        model.save_pretrained(path)
        out[family] = str(path)
    return out


def _reference(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


def our_logits(path: str, tp: int, ids: list[int], lora: str | None = None) -> torch.Tensor:
    """lora: a PEFT adapter directory to score with."""
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=16 << 20, block_size=4),
                          parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
                          lora=LoRAConfig(max_loras=1 if lora else 0, max_lora_rank=8))
    executor = make_executor(config, path, read_arch(path))
    try:
        if lora:
            executor.load_lora(1, 101, lora)
        return executor.score(ids, 101 if lora else 0)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(checkpoints, family, tp, request):
    """40 tokens: past every sliding window, and past Phi-3's original context (long LongRoPE factors)."""
    if tp > 1:
        request.getfixturevalue("ray_local")
    ids = _ids(40, 1)
    with torch.no_grad():
        expected = _reference(checkpoints[family])(torch.tensor([ids])).logits[0]
    got = our_logits(checkpoints[family], tp, ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_engine_equals_generate(checkpoints, family):
    """A batch of prompts of different lengths, two sharing a prefix (prefix cache), prefilled in
    chunks (a 16-token budget), in 4-token blocks so windows span several blocks."""
    path = checkpoints[family]
    # Phi-3: every prompt is past the original context, where transformers switches to the long
    # LongRoPE factors for the whole sequence; the engine uses them throughout (see layers/basic.py).
    base = PHI3_ORIGINAL_CTX + 1 if family == "phi3" else 3
    shared = _ids(base + 14, 7)
    prompts = [_ids(base, 2), shared + _ids(5, 3), _ids(base + 25, 4), shared + _ids(9, 5), _ids(base + 9, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref = _reference(path)
    eos = ref.config.eos_token_id
    expected = []
    for ids in prompts:
        with torch.no_grad():
            gen = ref.generate(torch.tensor([ids]), max_new_tokens=params.max_tokens, do_sample=False,
                               eos_token_id=eos, pad_token_id=eos)
        expected.append(gen[0, len(ids):].tolist())
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=16 << 20, block_size=4, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16),
        parallel=ParallelConfig(device="cpu")), eos_token_ids=[eos])
    try:
        # Phi-3 windows every layer: its blocks behind the window are freed as it runs.
        assert engine.block_manager.window == (12 if family == "phi3" else None)
        assert engine.generate(prompts, params) == expected
        assert engine.block_manager.prefix_hits > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_lora_matches_peft(checkpoints, family, tp, tmp_path, request):
    """A random adapter (non-zero B) on every projection PEFT can target in the family -- for Phi-3 the
    checkpoint's fused qkv_proj and gate_up_proj -- through our layers and through PEFT itself."""
    from peft import PeftModel

    if tp > 1:
        request.getfixturevalue("ray_local")
    path = checkpoints[family]
    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if family == "phi3" else tuple(TARGETS)
    adapter = random_peft_adapter(str(tmp_path / "adapter"), read_arch(path), rank=4, seed=3, targets=targets)
    ref = PeftModel.from_pretrained(_reference(path), adapter).eval()
    ids = _ids(40, 5)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
        with ref.disable_adapter():
            base = ref(torch.tensor([ids])).logits[0]
    assert (expected - base).abs().max() > 0.1  # the adapter really changes the output
    torch.testing.assert_close(our_logits(path, tp, ids, adapter), expected, atol=1e-4, rtol=1e-4)


def write_gguf(family: str, hf_dir: str, out_path: str) -> None:
    """The weights of `hf_dir` as llama.cpp's converter writes them for the architecture (F32)."""
    import gguf
    from safetensors.torch import load_file

    cfg = _config(family)
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}[family]
    name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(out_path, name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    w.add_eos_token_id(cfg.eos_token_id)
    if family == "phi3":
        w.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL_CTX)
        w.add_rope_dimension_count(PHI3_ROPE_DIMS)
        w.add_rope_freq_base(10000.0)
        w.add_sliding_window(cfg.sliding_window)
        scale = cfg.max_position_embeddings / PHI3_ORIGINAL_CTX
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(PHI3_ORIGINAL_CTX))))
        rope = cfg.rope_parameters
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    else:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        if family == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        else:
            w.add_rope_freq_base(1e6)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(4.0)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    (shard,) = [f for f in __import__("os").listdir(hf_dir) if f.endswith(".safetensors")]
    for hf_name, tensor in load_file(f"{hf_dir}/{shard}").items():
        if family != "phi3" and hf_name == "lm_head.weight":
            continue  # tied: llama.cpp's Gemma converter drops it
        t = tensor.float()
        if family != "phi3" and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp's Gemma norms multiply by the stored weight alone
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_gives_the_safetensors_logits(checkpoints, family, tmp_path):
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(family, checkpoints[family], path)
    arch = read_arch(path)
    assert arch.model_type == {"gemma3": "gemma3"}.get(family, family)
    ids = _ids(40, 9)
    torch.testing.assert_close(our_logits(path, 1, ids), our_logits(checkpoints[family], 1, ids),
                               atol=1e-5, rtol=1e-5)
