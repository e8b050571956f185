"""Replicated layers: RMSNorm, rotary embedding, SiLU-and-mul."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model_parallel.parallel import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, kernels=None):
        super().__init__()
        self.eps = eps
        self.kernels = kernels  # cpu_kernels.PagedKernels: one fused call for bf16 on CPU
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); fusing the residual add saves one pass over activations."""
        if (self.kernels is not None and self.kernels.vectorized and x.dtype == torch.bfloat16
                and self.weight.dtype == torch.bfloat16):
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        residual = x
        # Normalise in fp32 as the reference does, then cast back; one fused op rather than six
        # (per-op dispatch is a large share of a small-batch step on CPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype), residual


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


class RotaryEmbedding(nn.Module):
    """Neox-style rotary (rotate halves), as in Hugging Face Llama; cos/sin precomputed per position."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None = None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling or {})
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope scaling {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

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
        return torch.addcmul(xf * cos, xf.roll(x.shape[-1] // 2, -1), sin).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
