"""FP8 weights (rayllm/quant/fp8.py): the checkpoint configs' keys, FP8 checkpoints written here and read
back (weights times scales), the FP8 GEMM against its dequantized reference (torch's CPU _scaled_mm runs
the same row-wise scaled e4m3 GEMM as CUDA), and a tiny random-weight model's logits with FP8 weights
against bf16. On CPU the worker refuses `model.quantization: fp8` (no FP8 tensor cores); the logits test
lifts that refusal -- the one thing standing in for CUDA here -- to run the FP8 path on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from rayllm.quant.fp8 import FP8, Fp8Weight, fp8_refusal, quantize_rows, read_fp8_scheme
from rayllm.schema.config import ModelConfig


def ct_config(strategy: str, dynamic: bool = True, kind: str = "float") -> dict:
    """compressed-tensors' quantization_config as llm-compressor writes it for FP8 (W8A8-FP8)."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": kind, "strategy": "token" if dynamic else "tensor",
                                      "dynamic": dynamic, "symmetric": True}}}}


def test_scheme_keys_of_each_producer():
    s = read_fp8_scheme(ct_config("channel"))
    assert (s.producer, s.weight_strategy, s.dynamic_activations, s.ignore) == (
        "compressed-tensors", "channel", True, ("lm_head",))
    assert read_fp8_scheme(ct_config("tensor", dynamic=False)).weight_strategy == "tensor"
    assert not read_fp8_scheme(ct_config("tensor", dynamic=False)).dynamic_activations
    assert read_fp8_scheme(ct_config("channel", kind="int")) is None  # W8A8 int8: not FP8
    with pytest.raises(ValueError, match="strategy"):
        read_fp8_scheme(ct_config("group"))
    mo = read_fp8_scheme({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    assert (mo.producer, mo.weight_strategy, mo.dynamic_activations) == ("modelopt", "tensor", False)
    nested = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    assert read_fp8_scheme(nested).ignore == ("lm_head",)
    with pytest.raises(ValueError, match="NVFP4"):
        read_fp8_scheme({"quant_method": "modelopt", "quant_algo": "NVFP4"})
    assert read_fp8_scheme({"quant_method": "fp8", "weight_block_size": [128, 128]}).weight_strategy == "block"
    assert read_fp8_scheme({"quant_method": "gptq"}) is None


def test_config_and_device_refusal():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="exclude"):
        ModelConfig(quantization="fp8", weights="quantized")
    assert "CUDA" in fp8_refusal(torch.device("cpu"))


def tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # random weights
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, initializer_range=0.02)
    path = tmp_path / "base"
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("producer", ["ct-channel", "ct-tensor", "modelopt"])
def test_fp8_checkpoint_reads_as_weight_times_scale(tmp_path, producer):
    """An FP8 checkpoint written here (e4m3 weights, weight_scale per channel or per tensor, input_scale,
    ModelOpt's k/v scales) reads back as q * scale; other tensors as they are."""
    from safetensors.torch import load_file, save_file

    from rayllm.loader.loader import iter_safetensors, read_arch

    path = tiny_llama(tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    out, want = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):
            if producer == "ct-channel":
                q, scale = quantize_rows(t)
            else:
                scale = t.float().abs().amax().clamp(min=1e-12) / 448
                q = (t.float() / scale).to(FP8)
            out[name], out[name.replace(".weight", ".weight_scale")] = q, scale.float()
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.05)
            if producer == "modelopt" and "k_proj" in name:
                out[name.replace("k_proj.weight", "k_proj.k_scale")] = torch.tensor(1.0)
            want[name] = q.float() * scale
        else:
            out[name] = want[name] = t
    save_file(out, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = (ct_config(producer[3:]) if producer.startswith("ct")
                                  else {"quant_method": "modelopt", "quant_algo": "FP8"})
    (path / "config.json").write_text(json.dumps(cfg))
    read_arch(str(path))  # accepted (a GPTQ config is refused)
    got = dict(iter_safetensors(str(path)))
    assert got.keys() == want.keys()
    for name, t in want.items():
        torch.testing.assert_close(got[name].float(), t.float(), rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemm_matches_dequantized_reference(out_dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g)
    x = torch.randn(7, 160, generator=g).to(out_dtype)
    layer = Fp8Weight.from_dense(w)
    xq, xs = quantize_rows(x)
    ref = (xq.float() * xs) @ layer.dequantized(torch.float32).t()  # the same quantized operands, fp32 math
    got = layer(x)
    assert got.dtype == out_dtype
    # fp32 out: accumulation order only; bf16 out: one bf16 rounding (2^-8 relative).
    tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # and against the unquantized GEMM: e4m3 has 3 mantissa bits on both operands
    exact = x.float() @ w.t()
    assert ((got.float() - exact).norm() / exact.norm()).item() < 0.06
    # a per-tensor checkpoint scale is the same scale on every row
    scale = w.abs().amax() / 448
    per_tensor = Fp8Weight((w / scale).to(FP8), scale)
    torch.testing.assert_close(per_tensor.dequantized(torch.float32), (w / scale).to(FP8).float() * scale)


def test_fp8_model_logits_agree_with_bf16(tmp_path, monkeypatch):
    """Tiny random Llama, bf16, 64 positions: mean KL <= 0.01 (the issue's bar; measured 8e-5 here). The
    random model's logits are near-uniform, so near-ties flip top-1 (measured 0.906): top-1 >= 0.85 here;
    the issue's top-1 >= 0.98 is left to the GPU lane on the trimmed real model."""
    from rayllm.executor.executor import make_executor
    from rayllm.loader.loader import read_arch
    from rayllm.quant import fp8
    from rayllm.schema.config import CacheConfig, EngineConfig, ParallelConfig

    path = str(tiny_llama(tmp_path))
    monkeypatch.setattr(fp8, "fp8_refusal", lambda device: None)  # stands in for an FP8-capable GPU
    ids = [int(i) for i in torch.randint(0, 320, (64,), generator=torch.Generator().manual_seed(1))]
    logits = {}
    for quant in (None, "fp8"):
        config = EngineConfig(model=ModelConfig(model=path, dtype="bfloat16", quantization=quant),
                              cache=CacheConfig(kv_cache_bytes=16 << 20), parallel=ParallelConfig(device="cpu"))
        executor = make_executor(config, path, read_arch(path))
        try:
            logits[quant] = executor.score(ids, 0).float()
        finally:
            executor.shutdown()
    ref, got = logits[None], logits["fp8"]
    assert not torch.equal(ref, got)  # the FP8 path really ran
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean().item()
    print(f"fp8 vs bf16: top-1 agreement {top1:.3f}, mean KL {kl:.5f}")
    assert kl <= 0.01 and top1 >= 0.85
