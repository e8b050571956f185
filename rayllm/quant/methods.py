"""GGUF weights kept quantized (`model.weights: quantized`): decoded once from their blocks into
integer values with per-group scale and zero, and run by quantized kernels at every batch size.

Every supported type is `w = q * scale + zero` over groups along the input dimension:
- Q4_0 (d * (q - 8)), Q4_1 (d * q + m), Q4_K (super-block scales/mins give each 32 a scale and min):
  4-bit values in groups of 32 (`Int4GroupWeight`), run by cpu_qgemm's int4 x int8 kernel (activations
  quantized in groups of 32) where the CPU has AVX-512 VNNI and `small_batch_quant` is auto, else by
  torch's int4 weight-only kernel;
- Q8_0 (groups of 32), Q5_K (5-bit, groups of 32), Q6_K (6-bit, groups of 16): int8 values with
  per-group scales (`Int8GroupWeight`), expanded to the activation dtype one layer at a time.
A fused layer (q/k/v, gate/up) whose parts differ in type (Q4_K_M mixes Q4_K and Q6_K) takes the
int8 form. Scales are kept in the activation dtype (bf16 rounds GGUF's fp16 scales to 8 bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.platforms.cpu.qgemm import Int4VnniWeight
from rayllm.quant.gguf_blocks import RawBlocks, unpermute_rotary

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
QUANT_TYPES = INT4_TYPES | {"Q5_K", "Q6_K", "Q8_0"}
QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for eight sub-blocks (as gguf.quants unpacks them)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Low nibbles of each `width`-byte run, then its high nibbles (ggml's order)."""
    q = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(qs.shape[0], -1)


def decode_blocks(raw: RawBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q int8 [n, k], scale fp32 [n, k/g], zero fp32 [n, k/g], g) with w = q * scale + zero."""
    name = raw.qtype.name  # type: ignore[attr-defined]
    n, k = raw.shape
    b = raw.data.reshape(-1, raw.data.shape[1] // (k // (QK_K if name.endswith("_K") else 32)))
    if name in ("Q4_0", "Q4_1", "Q8_0"):
        d = _f16(b[:, :2])
        if name == "Q8_0":
            q, zero = b[:, 2:].view(np.int8), np.zeros_like(d)
        else:
            head = 2 if name == "Q4_0" else 4
            q = _nibbles(b[:, head:], 16)
            zero = -8 * d if name == "Q4_0" else _f16(b[:, 2:4])
        g, scale = 32, d
    elif name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        scale, zero = d * sc, -dmin * mn
        if name == "Q4_K":
            q = _nibbles(b[:, 16:], 32)
        else:
            qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = _nibbles(b[:, 48:], 32) | ((qh & 1).reshape(b.shape[0], -1) << 4)
        g = 32
    elif name == "Q6_K":
        ql = _nibbles(b[:, :128], 64).reshape(-1, 2, 128)  # two halves of 128 values
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = (ql | ((qh & 3).reshape(-1, 2, 128) << 4)).reshape(b.shape[0], -1).astype(np.int16) - 32
        scale = b[:, 192:208].view(np.int8).astype(np.float32) * _f16(b[:, 208:210])
        zero, g = np.zeros_like(scale), 16
    else:
        raise ValueError(f"GGUF type {name} cannot be kept quantized (supported: {sorted(QUANT_TYPES)})")
    q_t = torch.from_numpy(np.ascontiguousarray(q).astype(np.int8).reshape(n, k))
    rows = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(n, k // g)) for a in (scale, zero)]
    if raw.unpermute_heads:
        q_t, *rows = (unpermute_rotary(a, raw.unpermute_heads) for a in (q_t, *rows))
        q_t, rows = q_t.contiguous(), [r.contiguous() for r in rows]
    return q_t, rows[0], rows[1], g


class Int4GroupWeight:
    """4-bit values (0..15), groups of 32: cpu_qgemm's int4 x int8 kernel (`int8_activations`, bf16, a
    CPU with VNNI) or torch's int4 weight-only kernel. Either's per-row result does not depend on the
    batch's row count (so the layer is batch-invariant too). Both need the output rows in 16s: other
    layers (uneven tensor-parallel shards, an LM head over a vocab of 32001) take Int8GroupWeight's form."""

    all_batches = True  # a weight method for every step size; no dense weight is kept
    GROUP = 32
    ROWS = 16  # torch's int4 packing (and cpu_qgemm's tiles) take the output rows in 16s

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype,
                 int8_activations: bool = False, passes: int = 1):
        self.dtype = dtype
        self.vnni: Int4VnniWeight | None = None
        self.int8: Int8GroupWeight | None = None
        if int8_activations and dtype == torch.bfloat16 and cpu_qgemm.supports(*q.shape) and cpu_qgemm.available():
            self.vnni = Int4VnniWeight(q, scale, zero, passes)
            return
        if q.shape[0] % self.ROWS:
            self.int8 = Int8GroupWeight(q, scale, zero, dtype)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The kernel computes (q - 8) * scale + zero'; zero' = zero + 8 * scale. [k/32, n, 2].
        self.scales = torch.stack([scale, zero + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None:
            return self.vnni(x)
        if self.int8 is not None:
            return self.int8(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, self.GROUP, self.scales)
        return out.to(x.dtype)

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The weight method (layers/linear_method.py): these weights, plus the layer's bias."""
        out = self(x)
        return out if layer.bias is None else out + layer.bias

    def nbytes(self) -> int:
        if self.vnni is not None:
            return self.vnni.nbytes()
        if self.int8 is not None:
            return self.int8.nbytes()
        return self.packed.nbytes + self.scales.nbytes


class Int8GroupWeight:
    """int8 values with a scale and zero per group: the layer's weight is expanded into the activation
    dtype for each call (transient, one layer at a time), then one GEMM."""

    all_batches = True

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype):
        self.q = q
        self.group = q.shape[1] // scale.shape[1]
        self.scale = scale.to(dtype).unsqueeze(-1)
        self.zero = None if not zero.any() else zero.to(dtype).unsqueeze(-1)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.view(n, k // self.group, self.group).to(dtype) * self.scale.to(dtype)
        if self.zero is not None:
            w += self.zero.to(dtype)
        return w.view(n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype))

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        out = self(x)
        return out if layer.bias is None else out + layer.bias

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)


