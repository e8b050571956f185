"""GGUF blocks kept quantized (rayllm/quant/methods.py) reproduce gguf's own dequantize, and the
quantized kernels reproduce that dense weight times the activations.

Q4_0, Q4_1 and Q8_0 blocks come from `gguf.quants.quantize` of random weights; gguf has no
quantizer for the K types, so their blocks are random bytes (every byte pattern is a valid block)
with the fp16 super-block scales set to finite values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.quant.gguf_blocks import RawBlocks, unpermute_rotary
from rayllm.quant.methods import Int4GroupWeight, Int8GroupWeight, decode_blocks

N, K = 64, 512
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 scales in a block


def blocks(name: str, rng: np.random.Generator, n: int = N, k: int = K) -> np.ndarray:
    qtype = GGMLQuantizationType[name]
    if name not in FP16_FIELDS:
        return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        b[:, off : off + 2] = (rng.standard_normal(len(b)) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(n, -1)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("heads", [None, 4])
def test_decode_and_kernel_match_gguf_dequantize(name, heads):
    rng = np.random.default_rng(0)
    data = blocks(name, rng)
    qtype = GGMLQuantizationType[name]
    ref = torch.from_numpy(dequantize(data, qtype).reshape(N, K).astype(np.float32))
    if heads:  # q/k rows come back from llama.cpp's rotary order, as the dense loader does it
        ref = unpermute_rotary(ref, heads)
    q, scale, zero, group = decode_blocks(RawBlocks(data, qtype, (N, K), heads))
    dense = (q.float().view(N, -1, group) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(N, K)
    assert torch.equal(dense, ref)  # the decoded values are exactly gguf's

    kernel = (Int4GroupWeight if name.startswith("Q4") else Int8GroupWeight)(q, scale, zero, torch.bfloat16)
    x = torch.randn(40, K).bfloat16()
    got = kernel(x).float()
    want = x.float() @ ref.t()
    # bf16 scales (8 bits) and bf16 outputs: within a few bf16 ulps of the output scale.
    tol = 2e-2 * want.abs().max()
    assert (got - want).abs().max() <= tol, float((got - want).abs().max() / want.abs().max())
    assert torch.equal(kernel(x[:1]), kernel(x)[:1]) or name not in ("Q4_0", "Q4_1", "Q4_K")  # int4: row-invariant


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_layers_with_int8_activations_match_gguf_dequantize(name):
    """small_batch_quant auto: the 4-bit layers run cpu_qgemm's kernel (activations quantized to int8 in
    groups of 32); against gguf's own dequantized weights in fp32, within the int8 rounding."""
    if not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    data = blocks(name, np.random.default_rng(1))
    qtype = GGMLQuantizationType[name]
    ref = torch.from_numpy(dequantize(data, qtype).reshape(N, K).astype(np.float32))
    q, scale, zero, group = decode_blocks(RawBlocks(data, qtype, (N, K), None))
    kernel = Int4GroupWeight(q, scale[:, :: 32 // group], zero[:, :: 32 // group], torch.bfloat16,
                             int8_activations=True)
    assert kernel.vnni is not None
    x = torch.randn(40, K).bfloat16()
    got = kernel(x).float()
    want = x.float() @ ref.t()
    assert (got - want).norm() / want.norm() < 0.02
    assert torch.equal(kernel(x[7:8]), got[7:8].bfloat16())  # rows do not depend on the batch


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_int4_layer_with_rows_not_in_16s_loads_and_matches_gguf(name, int8_activations):
    """Output rows not a multiple of 16 (an LM head over a vocab of 32001, an uneven tensor-parallel shard):
    neither torch's int4 packing nor cpu_qgemm's tiles take them, so the layer runs Int8GroupWeight's form of
    the same values; against gguf's own dequantized weights in fp32, as the multiple-of-16 layers are."""
    n, k = 32001, 256
    data = blocks(name, np.random.default_rng(2), n, k)
    qtype = GGMLQuantizationType[name]
    ref = torch.from_numpy(dequantize(data, qtype).reshape(n, k).astype(np.float32))
    q, scale, zero, group = decode_blocks(RawBlocks(data, qtype, (n, k), None))
    kernel = Int4GroupWeight(q, scale[:, :: 32 // group], zero[:, :: 32 // group], torch.bfloat16,
                             int8_activations=int8_activations)
    assert kernel.vnni is None and kernel.int8 is not None
    x = torch.randn(5, k).bfloat16()
    got = kernel(x).float()
    want = x.float() @ ref.t()
    assert got.shape == (5, n)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max(), float((got - want).abs().max() / want.abs().max())
    assert kernel.nbytes() == kernel.int8.nbytes()


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes"])
def test_quantized_safetensors_refused_naming_the_method(tmp_path, method):
    """A config.json written by transformers for a tiny random Llama, with the quantization_config
    that GPTQ/AWQ exporters add: loading fails before any tensor is read, naming the method."""
    import json

    from transformers import LlamaConfig

    from rayllm.loader.loader import read_arch

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"quant_method '{method}'"):
        read_arch(str(tmp_path))


@pytest.mark.parametrize("scale_kind", ["tensor", "channel", "block"])
def test_fp8_checkpoint_dequantized_matches_transformers(tmp_path, scale_kind):
    """A tiny random Llama (weights random) saved by transformers, rewritten as an FP8 checkpoint the way
    FP8 exporters write one (e4m3 weights + weight_scale / weight_scale_inv, quant_method fp8): our
    logits equal transformers' on the dequantized weights (weight.float() * scale)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from rayllm.executor.executor import make_executor
    from rayllm.loader.loader import read_arch
    from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    fp8, dequant = {}, {}
    for name, w in tensors.items():
        if not (name.endswith("proj.weight")):
            fp8[name] = dequant[name] = w
            continue
        if scale_kind == "tensor":
            scale = w.abs().max() / 448
            full = scale
        elif scale_kind == "channel":
            scale = w.abs().amax(1, keepdim=True) / 448
            full = scale
        else:  # 128 x 128 blocks, DeepSeek-style weight_scale_inv
            blocks = w.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).abs().amax((1, 3)) / 448
            scale, full = blocks, blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        fp8[name] = q
        fp8[name.removesuffix(".weight") + (".weight_scale_inv" if scale_kind == "block" else ".weight_scale")] = scale
        dequant[name] = q.float() * full
    save_file(fp8, str(tmp_path / "model.safetensors"))
    data = json.loads((tmp_path / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(data))

    ref = LlamaForCausalLM(cfg).eval()
    ref.load_state_dict(dequant)
    ids = [int(x) for x in torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    config = EngineConfig(model=ModelConfig(model=str(tmp_path), dtype="float32"),
                          cache=CacheConfig(kv_cache_bytes=16 << 20), parallel=ParallelConfig(device="cpu"))
    executor = make_executor(config, str(tmp_path), read_arch(str(tmp_path)))
    try:
        got = executor.score(ids)
    finally:
        executor.shutdown()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
