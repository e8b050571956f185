"""A CPU stand-in for `xformers.ops.fmha` (xformers has no CPU ops and this machine has no CUDA).

It computes what xformers documents for memory_efficient_attention_forward with its
PagedBlockDiagonalCausalWithOffsetPaddedKeysMask (K/V [1, pages * page_size, G, H, D]; sequence b reads
logical key j from page block_tables[b, j // page_size]; query i of a q_len-row block attends keys
j <= i + kv_len - q_len), its BlockDiagonalCausalFromBottomRightMask and its local variant
BlockDiagonalCausalLocalAttentionFromBottomRightMask (also q - window < k), with an optional scale. It reads the bias's tensors
(what the CUDA kernels read) and checks that the Python-side fields bound them. It can refuse
what a given xformers build refuses (its split-k kernel: paged steps of equal query lengths <= 16).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import torch


@dataclass
class _SeqLenInfo:  # xformers.ops.fmha.attn_bias._SeqLenInfo's fields
    seqstart: torch.Tensor
    max_seqlen: int
    min_seqlen: int
    seqstart_py: list[int]


@dataclass
class _PaddedSeqLenInfo(_SeqLenInfo):
    seqlen: torch.Tensor
    seqlen_py: list[int]
    padding: int


@dataclass
class _PagedCausalMask:  # PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
    q_seqinfo: _SeqLenInfo
    k_seqinfo: _PaddedSeqLenInfo
    block_tables: torch.Tensor
    page_size: int


class _BottomRightMask:
    window: int | None = None

    def __init__(self, q_lens: list[int], kv_lens: list[int]) -> None:
        self.q_lens, self.kv_lens = q_lens, kv_lens

    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int]) -> _BottomRightMask:
        return cls(list(q_seqlen), list(kv_seqlen))


class _LocalBottomRightMask(_BottomRightMask):
    @classmethod
    def from_seqlens(cls, q_seqlen: list[int], kv_seqlen: list[int], window_size: int) -> _LocalBottomRightMask:
        mask = cls(list(q_seqlen), list(kv_seqlen))
        mask.window = window_size
        return mask


def _attend(qs, ks, vs, scale: float | None = None, window: int | None = None):
    """[ql, G, H, K] queries over [kl, G, H, K] keys, causal aligned bottom-right (and within a window)."""
    ql, kl = qs.shape[0], ks.shape[0]
    scores = torch.einsum("qghd,kghd->ghqk", qs, ks) * (qs.shape[-1] ** -0.5 if scale is None else scale)
    q_pos = torch.arange(ql)[:, None] + kl - ql
    allowed = torch.arange(kl)[None, :] <= q_pos
    if window is not None:
        allowed &= torch.arange(kl)[None, :] > q_pos - window
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("ghqk,kghd->qghd", probs, vs)


class FakeFmha:
    def __init__(self, refuse: str = "") -> None:
        self.refuse = refuse  # "": every paged step; "splitk": equal q lengths <= 16 only; "all": none
        self.calls: list[str] = []
        self.attn_bias = types.SimpleNamespace(
            _SeqLenInfo=_SeqLenInfo, _PaddedSeqLenInfo=_PaddedSeqLenInfo,
            PagedBlockDiagonalCausalWithOffsetPaddedKeysMask=_PagedCausalMask,
            BlockDiagonalCausalFromBottomRightMask=_BottomRightMask,
            BlockDiagonalCausalLocalAttentionFromBottomRightMask=_LocalBottomRightMask)

    def memory_efficient_attention_forward(self, q, k, v, attn_bias, scale: float | None = None):
        if isinstance(attn_bias, _PagedCausalMask):
            return self._paged(q, k, v, attn_bias, scale)
        self.calls.append("gathered")
        out = torch.empty_like(q)
        qo = ko = 0
        for ql, kl in zip(attn_bias.q_lens, attn_bias.kv_lens, strict=True):
            out[0, qo:qo + ql] = _attend(q[0, qo:qo + ql], k[0, ko:ko + kl], v[0, ko:ko + kl], scale,
                                         attn_bias.window)
            qo, ko = qo + ql, ko + kl
        return out

    def _paged(self, q, k, v, bias: _PagedCausalMask, scale: float | None = None):
        qi, ki, ps = bias.q_seqinfo, bias.k_seqinfo, bias.page_size
        if self.refuse == "all" or (self.refuse == "splitk" and (qi.min_seqlen != qi.max_seqlen or qi.max_seqlen > 16)):
            raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs: ...")
        self.calls.append("paged")
        starts, lens = qi.seqstart.tolist(), ki.seqlen.tolist()
        assert starts == qi.seqstart_py and starts[-1] == q.shape[1]
        # Kernels read lengths from the tensor; the Python side must bound them (under CUDA graphs it
        # holds the capture-time upper bounds, as xformers' in-place updates allow).
        assert all(n <= bound for n, bound in zip(lens, ki.seqlen_py, strict=True)) and ki.max_seqlen >= max(lens)
        assert bias.block_tables.dtype == torch.int32 and ki.padding == bias.block_tables.shape[1] * ps
        assert ki.seqstart.tolist() == ki.seqstart_py == [b * ki.padding for b in range(len(lens) + 1)]
        assert k.shape[1] % ps == 0 and max(lens) <= ki.padding
        out = torch.empty_like(q)
        for b, kl in enumerate(lens):
            logical = torch.arange(kl)
            rows = bias.block_tables[b].long()[logical // ps] * ps + logical % ps
            out[0, starts[b]:starts[b + 1]] = _attend(q[0, starts[b]:starts[b + 1]], k[0, rows], v[0, rows], scale)
        return out


def install_fake_xformers(monkeypatch, refuse: str = "") -> FakeFmha:
    """Put a FakeFmha where `from xformers.ops import fmha` finds it (undone by monkeypatch)."""
    fmha = FakeFmha(refuse)
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha  # type: ignore[attr-defined]
    pkg = types.ModuleType("xformers")
    pkg.ops = ops  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "xformers", pkg)
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    return fmha
