"""FP8 (e4m3) weights run by FP8 GEMMs: `model.quantization: fp8`, and the FP8 checkpoints' configs.

`Fp8Weight` is a linear layer's weight method (layers/linear_method.py; the loader picks it in weight_methods.py):
e4m3 weights with one fp32 scale per output channel; each call quantizes its activations per token
(dynamic: amax / 448 per row, no host sync, fixed shapes, so it is CUDA-graph safe) and runs
`torch._scaled_mm` with row-wise scales, output in the activation dtype. A per-tensor checkpoint scale
is the same scale repeated over the rows, so a fused layer whose parts have different per-tensor
scales (q/k/v, gate/up) is exact in this form.

FP8 GEMMs need compute capability 8.9+ (Ada, Hopper). Elsewhere `fp8_refusal` names the reason and the
worker refuses `model.quantization: fp8` at load; FP8 checkpoints keep the dequantize-at-load path
(rayllm/loader/fp8.py) there. The LM head and the embedding stay in the model dtype (as vLLM and the
checkpoints' `ignore: [lm_head]` do): the logits are the most sensitive to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Fp8Scheme:
    """What an FP8 checkpoint's config says about its weights and activations."""

    producer: str  # fp8 (transformers' FineGrainedFP8 / plain), compressed-tensors (llm-compressor), modelopt
    weight_strategy: str  # tensor | channel | block
    dynamic_activations: bool  # activation scales computed per token at run time (else static `input_scale`)
    ignore: tuple[str, ...] = ()


def read_fp8_scheme(quant: dict) -> Fp8Scheme | None:
    """The scheme of a config.json `quantization_config` (or ModelOpt's hf_quant_config.json), None when
    it is not an FP8 checkpoint; ValueError for FP8-looking configs we cannot run (naming the key)."""
    method = quant.get("quant_method")
    if method == "fp8":  # transformers' FP8: weight_block_size -> block scales (`weight_scale_inv`)
        block = quant.get("weight_block_size")
        return Fp8Scheme("fp8", "block" if block else "channel", quant.get("activation_scheme", "dynamic") == "dynamic",
                         tuple(quant.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        groups = quant.get("config_groups") or {}
        schemes = []
        for name, group in groups.items():
            w, a = group.get("weights") or {}, group.get("input_activations")
            if w.get("type") != "float" or w.get("num_bits") != 8:
                return None  # int8 / int4 / nvfp4: not FP8
            if w.get("strategy") not in ("tensor", "channel", "block"):
                raise ValueError(f"quantization_config.config_groups.{name}.weights.strategy {w.get('strategy')!r}: "
                                 "FP8 weights must be per tensor, channel or block")
            dynamic = a is None or bool(a.get("dynamic"))
            schemes.append(Fp8Scheme("compressed-tensors", w["strategy"], dynamic, tuple(quant.get("ignore") or ())))
        if not schemes:
            return None
        if len(set(schemes)) > 1:
            raise ValueError("quantization_config.config_groups: FP8 groups with different schemes are not supported")
        return schemes[0]
    if method == "modelopt" or "quant_algo" in quant or "quantization" in quant:
        inner = quant.get("quantization", quant)  # hf_quant_config.json nests it under "quantization"
        algo = inner.get("quant_algo")
        if algo is None or str(algo).upper() != "FP8":
            return None if algo is None else _unsupported_algo(algo)
        # ModelOpt FP8: per-tensor weight_scale and a static per-tensor input_scale.
        return Fp8Scheme("modelopt", "tensor", False, tuple(inner.get("exclude_modules") or ()))
    return None


def _unsupported_algo(algo: str) -> None:
    raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported (only FP8)")


def fp8_refusal(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device`, or None when they can."""
    if device.type != "cuda":
        return (f"model.quantization: fp8 needs a CUDA GPU with FP8 (compute capability 8.9+: Ada, Hopper); "
                f"this worker runs on {device.type} (FP8 checkpoints load dequantized without it)")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"model.quantization: fp8 needs compute capability 8.9+ (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    return None


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric e4m3 per row: (q [n, k], scale fp32 [n, 1]) with w ~= q * scale."""
    scale = w.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8Weight:
    """One linear layer's weight as e4m3 with per-output-channel scales; every step size runs FP8."""

    all_batches = True  # a weight method for every step size; the layer releases its dense weight

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        """q [n, k] e4m3; scale fp32: one per row ([n] or [n, 1]) or one for the tensor."""
        n = q.shape[0]
        self.q_t = q.t()  # [k, n] column-major, the layout _scaled_mm wants for its second operand
        self.scale = scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()

    @classmethod
    def from_dense(cls, w: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(w)
        return cls(q, scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q_t.t().float() * self.scale.t()).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xq, xs = quantize_rows(x2)
        out = torch._scaled_mm(xq, self.q_t, scale_a=xs, scale_b=self.scale, out_dtype=x.dtype)
        return out.reshape(*shape[:-1], out.shape[-1])

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = self(x)
        return out if layer.bias is None else out + layer.bias

    def nbytes(self) -> int:
        return self.q_t.numel() + self.scale.nbytes


def fp8_fits(weight: torch.Tensor) -> bool:
    """_scaled_mm on CUDA wants both GEMM dimensions divisible by 16 (other layers stay dense)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
