"""Replicated layers: RMSNorm, rotary embedding, SiLU-and-mul."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rayllm.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels=None):
        super().__init__()
        self.eps = eps
        self.kernels = kernels  # cpu_kernels.PagedKernels: one fused call for bf16 on CPU
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); fusing the residual add saves one pass over activations."""
        weight = self.weight
        if self.kernels is not None and x.dtype in self.kernels.fused_dtypes and weight.dtype == x.dtype:
            return self.kernels.add_rms_norm(x, residual, weight, self.eps)
        if residual is not None:
            x = x + residual
        residual = x
        # Normalise in fp32 as the reference does, then cast back; one fused op rather than six
        # (per-op dispatch is a large share of a small-batch step on CPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return weight * normed.to(x.dtype), residual


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float, dim: int,
                   max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between (transformers' _compute_yarn_parameters)."""
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate, float(attention_factor)


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int,
                       context_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE / su (Phi-3): per-frequency divisors, long ones when the context exceeds the original one.

    The choice is made once for the whole table, from the context served (as llama.cpp does): keys in
    the paged cache are never re-rotated, so every position must use the same set."""
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_ctx
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    ext = scaling["long_factor"] if context_len > old_ctx else scaling["short_factor"]
    return inv_freq / torch.tensor(ext, dtype=torch.float64), float(attention_factor)


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
                  context_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float64, attention factor applied to cos and sin) for a rope
    scaling dict as in config.json (`rope_type` or legacy `type`); formulas as transformers'
    ROPE_INIT_FUNCTIONS."""
    scaling = scaling or {}
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, theta, dim, max_position)
    if rope_type in ("longrope", "su"):
        return _longrope_inv_freq(inv_freq, scaling, max_position, context_len or max_position)
    if rope_type == "dynamic":
        # Dynamic NTK changes the base only for sequences longer than max_position_embeddings, which
        # max_model_len never allows: within it the frequencies are the default ones (as transformers).
        return inv_freq, 1.0
    if rope_type not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {rope_type!r}")
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """Neox-style rotary (rotate halves), as in Hugging Face Llama; cos/sin precomputed per position.

    rotary_dim < head_dim rotates only the first rotary_dim features of each head (partial rotary)."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        inv_freq, attention_factor = rope_inv_freq(self.rotary_dim, theta, scaling, max_position)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # Factors from YaRN / LongRoPE scale cos and sin, hence both q and k, as transformers does.
        self.register_buffer("cos", (freqs.cos() * attention_factor).float(), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).float(), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step, shared by every layer: cos over the whole head dim, and sin signed for the
        rotated half, each [T, 1, D] (fp32)."""
        cos, sin = self.cos[positions], self.sin[positions]
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, H, D] (q and k heads together). x * cos + rotate_half(x) * sin, in fp32; five ops
        for all heads of a layer, where rotating q and k apart took twenty (each op costs ~5 us of
        dispatch on CPU, which at batch 1 is a third of a step)."""
        cos, sin = tables
        xf = x.float()
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return torch.addcmul(xf * cos, xf.roll(rot // 2, -1), sin).to(x.dtype)
        xr = xf[..., :rot]  # partial rotary: the remaining features pass through
        return torch.cat((torch.addcmul(xr * cos, xr.roll(rot // 2, -1), sin), xf[..., rot:]), -1).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
