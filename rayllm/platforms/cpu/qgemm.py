"""4-bit weights x 8-bit activations on CPUs with AVX-512 VNNI (csrc/qgemm.c), for steps of few rows.

A linear layer whose checkpoint was 4-bit keeps its weight in groups of 32 inputs (w = d * q + m, as
GGUF's Q4_1); each call quantizes the step's rows to int8 in groups of 32 (as llama.cpp's Q8_1) and
sums int8 products, which this CPU does at twice bf16's rate and from a quarter of bf16's bytes.
"""

from __future__ import annotations

import ctypes
from functools import cache

import torch

from rayllm.platforms.cpu import kernels as cpu_kernels

GROUP = 32
TILE = 16  # output columns per tile


class _Lib:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self.gemm = cpu_kernels._bind(lib, "qgemm_int4_bf16", [p, i64, p, p, i, i, i, i, i, i, i], ctypes.c_int)


class PoolThreads:
    """How many threads the kernel's own pool (csrc/pool.c) gives a call made on one torch thread:
    `parallel.cpu.qgemm_threads` (0 or 1: none). Paused while a step runs in halves (split_step.py), where
    each half already holds a core. At more torch threads the kernel splits its tiles with OpenMP."""

    threads = 0
    paused = False

    def for_call(self) -> tuple[int, int]:
        """(OpenMP threads, pool threads) for a call now."""
        torch_threads = torch.get_num_threads()
        if torch_threads == 1 and not self.paused and self.threads > 1:
            return 1, self.threads
        return torch_threads, 0


POOL = PoolThreads()


@cache
def _lib() -> _Lib | None:
    if cpu_kernels.load() is None:  # no compiler, or turned off: logged there
        return None
    lib = ctypes.CDLL(str(cpu_kernels.build()))
    lib.qgemm_available.restype = ctypes.c_int
    return _Lib(lib) if lib.qgemm_available() else None


def available() -> bool:
    """Whether the kernels were built with AVX-512 VNNI (else the caller keeps torch's int4 kernel)."""
    return _lib() is not None


def supports(n: int, k: int) -> bool:
    return n % TILE == 0 and k % GROUP == 0 and k > 0


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q: 4-bit values [N, K] (any integer dtype, 0..15); d, m: [N, K/32] with w = d * (q - o) + m.
    Returns the kernel's layout: uint8 [N/16, K/32, 320] (per tile and group: 256 bytes of nibbles,
    then d and m as 16 fp16 each)."""
    n, k = q.shape
    tiles, groups = n // TILE, k // GROUP
    # [tile, group, word i (inputs 4i..4i+3), column, j]: word i in the low nibbles, word i + 4 in the high.
    t = q.to(torch.uint8).view(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    nibbles = (t[:, :, :4] | (t[:, :, 4:] << 4)).reshape(tiles, groups, 256)
    scales = torch.stack([d.float(), m.float()]).to(torch.float16)  # [2, N, G]
    scales = scales.view(2, tiles, TILE, groups).permute(1, 3, 0, 2).reshape(tiles, groups, 2 * TILE)
    return torch.cat([nibbles, scales.view(torch.uint8)], -1).contiguous()


class Int4VnniWeight:
    """A layer's weight packed for qgemm_int4_bf16; called with bf16 rows [M, K] -> bf16 [M, N].
    passes 2: each row's int8 quantization residual is quantized and multiplied too (parallel.cpu.int8_passes).
    zero_offset o: w = d * (q - o) + m; 8 takes torch's int4 kernel's bf16 scale and zero as they are (fp16
    holds both exactly; their m = zero - 8d in fp16 would be rounded, turning ~1 in 7 outputs' last bit)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, passes: int = 1, zero_offset: int = 0) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("the CPU kernels have no AVX-512 VNNI build on this machine")
        self._gemm = lib.gemm
        if passes not in (1, 2):
            raise ValueError("int4 VNNI GEMM: passes must be 1 or 2")
        self.passes = passes
        if zero_offset not in (0, 8):
            raise ValueError("int4 VNNI GEMM: zero_offset must be 0 or 8")
        self.zero_offset = zero_offset
        self.n, self.k = q.shape
        self.packed = pack(q, d, m)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"int4 VNNI GEMM: x must be bf16 [M, {self.k}]")
        out = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        if x.shape[0] == 0:
            return out
        if x.stride(1) != 1:
            x = x.contiguous()
        code = self._gemm(x.data_ptr(), x.stride(0), self.packed.data_ptr(), out.data_ptr(), x.shape[0], self.n,
                          self.k, self.passes, self.zero_offset, *POOL.for_call())
        if code == 1:
            raise MemoryError("int4 VNNI GEMM: out of memory for the quantized rows")
        if code:
            raise ValueError(f"int4 VNNI GEMM: unsupported shape [{x.shape[0]}, {self.k}] x [{self.k}, {self.n}]")
        return out

    def nbytes(self) -> int:
        return self.packed.nbytes


class Int8VnniWeight:
    """An 8-bit weight in groups of 32 (GGUF's Q8_0: w = d * q, q in -127..127), e.g. a tied LM head, run on
    the 4-bit kernel as two 4-bit planes: q + 128 = 16 * hi + lo, so w = 16d * hi - 128d + d * lo, and the
    planes side by side along the input make one GEMM with K doubled (each row given twice). Both
    activation passes: the product is the Q8_0 weight's to bf16 rounding, from 1.25 bytes a weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        g = weight.float().view(n, k // GROUP, GROUP)
        # The group's largest |w| was q = +-127 in Q8_0, so its scale and values come back from the weight.
        d = g.abs().amax(-1) / 127
        q = (g / d.clamp(min=1e-30).unsqueeze(-1)).round().clamp(-127, 127).to(torch.int32) + 128
        self.k = k
        self.inner = Int4VnniWeight(torch.cat([(q >> 4).view(n, k), (q & 15).view(n, k)], 1),
                                    torch.cat([16 * d, d], 1), torch.cat([-128 * d, torch.zeros_like(d)], 1), passes=2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.cat([x, x], 1))

    def nbytes(self) -> int:
        return self.inner.nbytes()
