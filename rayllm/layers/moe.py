"""Mixture-of-experts feed-forward: a replicated router, top-k routing, and every expert's SwiGLU MLP
computed as one GEMM pair per expert per step over the tokens routed to it.

Sharding: each rank holds a slice of every expert's intermediate dim (as the dense MLP is split),
so the routed output of a rank is a partial sum and one all_reduce per layer completes it (the
shared expert's partial sum rides on the same all_reduce). Splitting whole experts across ranks
instead would leave a rank idle whenever routing is skewed, and needs token exchange between
ranks; slicing every expert keeps the work per rank equal whatever the router does.

Expert weights are stacked per layer: w13 [E, 2 * I_local, H] (gate rows, then up rows) and
w2 [E, H, I_local]. A Hugging Face checkpoint fills them one expert tensor at a time; a GGUF holds
each of gate / up / down already stacked over experts (llama.cpp's ffn_*_exps) and fills all
experts in one call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rayllm.layers.basic import silu_and_mul
from rayllm.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    _set_weight_loader,
    default_weight_loader,
    piece,
)
from rayllm.schema.config import LlamaArch


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    renormalize: bool  # top-k weights divided by their sum (Mixtral; Qwen with norm_topk_prob)
    shared_intermediate_size: int = 0  # Qwen2-MoE's shared expert (0: none)

    @classmethod
    def from_arch(cls, arch: LlamaArch, renormalize_default: bool = False) -> MoEConfig:
        """Reads config.json names, or the GGUF metadata names llama.cpp's converter writes.
        renormalize_default: the family's rule where the checkpoint does not say (models/)."""
        num_experts = arch.cfg("num_local_experts") or arch.cfg("num_experts") or arch.cfg("expert_count") or 0
        renorm = arch.cfg("norm_topk_prob", arch.cfg("expert_weights_norm", renormalize_default))
        return cls(
            num_experts=int(num_experts),
            top_k=int(arch.cfg("num_experts_per_tok") or arch.cfg("expert_used_count") or 0),
            intermediate_size=int(arch.cfg("moe_intermediate_size") or arch.cfg("expert_feed_forward_length")
                                  or arch.intermediate_size),
            renormalize=bool(renorm),
            shared_intermediate_size=int(arch.cfg("shared_expert_intermediate_size")
                                         or arch.cfg("expert_shared_feed_forward_length") or 0),
        )


def sparse_layer_ids(arch: LlamaArch) -> set[int]:
    """Layers whose MLP is a mixture of experts. Qwen MoE configs may keep some dense
    (`mlp_only_layers`, `decoder_sparse_step`); a GGUF has neither key, and llama.cpp makes every
    layer sparse, as does Mixtral."""
    if MoEConfig.from_arch(arch).num_experts <= 0:
        return set()
    dense = set(arch.cfg("mlp_only_layers", []))
    step = int(arch.cfg("decoder_sparse_step", 1))
    return {i for i in range(arch.num_layers) if i not in dense and (i + 1) % step == 0}


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): softmax over all experts, top-k, optionally renormalised
    (softmax-then-renormalise equals Mixtral's softmax over the top-k logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, [T, H].

    The T * k (token, expert) pairs are sorted by expert id, so each expert's tokens are contiguous:
    one gate/up GEMM and one down GEMM per expert that has tokens this step, then the weighted
    rows are scattered back onto their tokens.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # one host sync per layer
    xs = x.index_select(0, token_of)
    ys = torch.empty(t * k, w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            ys[rows] = F.linear(silu_and_mul(F.linear(xs[rows], w13[expert])), w2[expert])
            start += n
    ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1).to(ys.dtype))
    return torch.zeros_like(x).index_add_(0, token_of, ys)


class ReplicatedLinear(nn.Module):
    """A small projection every rank holds whole (the router, the shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        # GGUF stores a one-row weight (Qwen2-MoE's shared expert gate) as a vector.
        default_weight_loader(param, loaded.reshape(param.shape) if loaded.numel() == param.numel() else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """Router + routed experts (+ an optional gated shared expert); output all-reduced once."""

    # fused_experts reads each expert's token count on the host (one sync per layer), which a CUDA graph
    # cannot capture: models with these layers decode eagerly (runner.cuda_graphs.model_capturable).
    capturable = False

    def __init__(self, arch: LlamaArch, cfg: MoEConfig, tp: TPGroup):
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.num_experts:
            raise ValueError(f"experts per token ({cfg.top_k}) must be in 1..{cfg.num_experts}")
        self.tp = tp
        self.cfg = cfg
        h, e = arch.hidden_size, cfg.num_experts
        self.i_start, self.i_size = piece(cfg.intermediate_size, tp.size, tp.rank)
        self.gate = ReplicatedLinear(h, e)
        self.w13 = nn.Parameter(torch.empty(e, 2 * self.i_size, h), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, self.i_size), requires_grad=False)
        _set_weight_loader(self.w13, self._load_w13, 2 * e)
        _set_weight_loader(self.w2, self._load_w2, e)
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if cfg.shared_intermediate_size:
            # No all_reduce inside (a size-1 group): its partial sum joins the experts' single one.
            self.shared_expert = SharedExpert(h, cfg.shared_intermediate_size, tp)
            self.shared_expert_gate = ReplicatedLinear(h, 1)

    def _dst(self, param: nn.Parameter, expert: int | None) -> torch.Tensor:
        return param.data if expert is None else param.data[expert]

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, int]) -> int:
        """shard: (expert id, or None for all experts stacked; 0 gate / 1 up). Returns tensors filled."""
        expert, half = shard
        src = loaded.narrow(-2, self.i_start, self.i_size)
        dst = self._dst(param, expert).narrow(-2, half * self.i_size, self.i_size)
        if dst.shape != src.shape:
            raise ValueError(f"expert shard: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
        dst.copy_(src)
        return 1 if expert is not None else param.shape[0]

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, int]) -> int:
        expert, _ = shard
        src = loaded.narrow(-1, self.i_start, self.i_size)
        dst = self._dst(param, expert)
        if dst.shape != src.shape:
            raise ValueError(f"expert shard: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
        dst.copy_(src)
        return 1 if expert is not None else param.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.cfg.top_k, self.cfg.renormalize)
        out = fused_experts(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP sliced like LlamaMLP, returning this rank's partial sum (no all_reduce)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, tp)
        in_start, in_size = piece(intermediate, tp.size, tp.rank)
        self.down_proj = RowParallelLinear(in_start, in_size, hidden, TPGroup())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


# Hugging Face expert tensor names: `<prefix>experts.<e>.<proj>.weight` (one expert), or stacked over
# experts as a GGUF gives them (iter_gguf names them `<prefix>experts.<proj>.weight`).
_EXPERT = re.compile(r"^(.*\.)experts\.(?:(\d+)\.)?(\w+)\.weight$")


def expert_param(name: str, projections: dict[str, int]) -> tuple[str, tuple[int | None, int]] | None:
    """Map an expert tensor to (our stacked parameter, (expert id or None, sub-projection)).

    projections: checkpoint projection name -> 0 gate, 1 up, 2 down (Mixtral: w1, w3, w2).
    """
    m = _EXPERT.match(name)
    if m is None or m.group(3) not in projections:
        return None
    which = projections[m.group(3)]
    expert = None if m.group(2) is None else int(m.group(2))
    return f"{m.group(1)}{'w2' if which == 2 else 'w13'}", (expert, which)
