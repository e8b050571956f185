"""oneDNN's prepacked GEMM on CPU: dense bf16/fp32 weights reordered once at load into its blocked layout."""

from __future__ import annotations

from typing import Any

import torch


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can lay out and run `dtype` weights here. bf16 also needs the CPU's bf16 GEMMs (AVX-512
    BW/VL/DQ or AVX-NE-CONVERT): without them (AMD Zen 2/3, AVX2-only Intel, Graviton2) torch's bf16 reorder
    raises at load, so such CPUs keep plain F.linear for bf16."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class OneDNNWeight:
    """A weight in oneDNN's blocked layout, reordered once at load (CPU, bf16 or fp32).

    F.linear hands oneDNN a plain weight, which its AMX/AVX-512 GEMM re-packs on every call: a full
    extra pass over the weights each step (measured in docs/benchmarks.md). Same kernel, same results
    (bit-equal in the tests).

    Batch-invariant mode (`row_block`): with the layout hint 64, a row's result changes once the row
    count M passes 32 (another blocking); with hint 1 it holds for small M but the reduction is split
    differently once M x K grows (K=1536: from M ~200). One row alone takes yet another kernel, whose
    sums round differently for some inputs (seen on AMD EPYC at K=1536: the last row of a prefill,
    alone in its block, changed with the batch). So the weight is laid out with hint 1, every call
    runs in blocks of at most `row_block` rows, and a single row is padded to two: the largest block
    that a probe at load finds bit-equal to each row computed in a two-row call (once per shape).
    """

    all_batches = False  # a weight method (layers/linear_method.py) over the layer's dense weight

    def __init__(self, weight: torch.Tensor, batch_invariant: bool = False):
        # The batch size is only a hint for the layout; every batch size runs on the result.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1 if batch_invariant else 64)
        self.row_block = _row_block(self, tuple(weight.shape), weight.dtype) if batch_invariant else 0

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")

    def _block(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """A block of rows; one row goes through a two-row call (a zero row beside it)."""
        if x.shape[0] != 1:
            return self._gemm(x, bias)
        return self._gemm(torch.nn.functional.pad(x, (0, 0, 0, 1)), bias)[:1]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.row_block:
            return self._gemm(x, bias)
        if x.shape[0] <= self.row_block:
            return self._block(x, bias)
        return torch.cat([self._block(part, bias) for part in x.split(self.row_block)])

    def apply(self, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """The weight method's entry point: x through this weight, plus the layer's bias."""
        return self(x, layer.bias)


ROW_BLOCKS = (128, 64, 32, 16, 8, 4)
# Probed row blocks by (weight shape, dtype, torch threads). oneDNN picks its kernel and its blocking of the
# reduction from the shapes, the ISA, the caches and the threads, not from the values, so every layer of one
# shape gets the same answer: a model probes each of its few shapes once (30 layers: 121 probes were ~2.7 s of
# its start), and the answers are kept on disk for the next process on this machine (row_block_store.py:
# SmolLM2's five shapes were ~1.1 s of CPU in every batch-invariant bf16 start).
_ROW_BLOCKS: dict[tuple, int] = {}


def _row_block(gemm: OneDNNWeight, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    from rayllm.platforms.cpu import row_block_store

    key = (shape, dtype, torch.get_num_threads())
    if key not in _ROW_BLOCKS:
        block = row_block_store.stored(*key)
        if block not in (*ROW_BLOCKS, 1):  # none kept (or not one a probe returns): probe, and keep it
            block = _probe_row_block(gemm, shape[1], dtype)
            row_block_store.store(*key, block)
        _ROW_BLOCKS[key] = block
    return _ROW_BLOCKS[key]


def _probe_row_block(gemm: OneDNNWeight, k: int, dtype: torch.dtype) -> int:
    """The largest row block whose every row equals that row's result in a two-row call (the shape a
    single row runs in), at 1 and 2 threads."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROW_BLOCKS[0], k, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        pairs = torch.cat([gemm._block(x[i : i + 1], None) for i in range(x.shape[0])])
        for block in ROW_BLOCKS:
            ok = True
            for t in {1, 2, threads}:
                torch.set_num_threads(t)
                ok = ok and all(torch.equal(gemm._gemm(x[:m], None), pairs[:m]) for m in (block, block - 1, block // 2 + 1))
            if ok:
                return block
    finally:
        torch.set_num_threads(threads)
    return 1  # every row in its own two-row call: the reference itself
