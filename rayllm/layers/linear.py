"""Tensor-parallel building blocks. The TP group is passed in explicitly; every collective is in a forward.

Partitions may be uneven (SmolLM2 has 3 KV heads, which TP=2 splits 2+1), so each layer is told
exactly which slice it owns, and each parameter carries a `weight_loader` that cuts its own slice
out of the full checkpoint tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rayllm.layers.linear_method import ALL_STEPS, LinearBase, SmallBatchMethod
from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.platforms.cpu.onednn import OneDNNWeight
from rayllm.platforms.cpu.qgemm import Int4VnniWeight, Int8VnniWeight


def split_evenly(n: int, parts: int) -> list[int]:
    """Sizes of `parts` near-equal pieces of n; earlier pieces take the remainder."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def piece(n: int, parts: int, rank: int) -> tuple[int, int]:
    """(start, size) of rank's piece of n."""
    sizes = split_evenly(n, parts)
    return sum(sizes[:rank]), sizes[rank]


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    # The in-place sum across ranks that every all_reduce below goes through (allreduce.make_all_reduce
    # picks it: NCCL, gloo or DeepSpeed's shm kernel); needed when size > 1.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.size > 1 and self.reduce is None:
            raise ValueError("a TPGroup of more than one rank needs its reduce function")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None and self.size > 1:
            return self.reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-width shards along the last dim on every rank."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


# At or below these many tokens per step, the weight-only kernels beat oneDNN's bf16 GEMM with
# prepacked weights (docs/benchmarks.md): torch's int4 kernel up to 8, the LM head's up to 4; the int4 x
# int8 VNNI kernel (cpu_qgemm) at every size measured, so it keeps the GEMMs up to a prefill chunk's
# size, and oneDNN takes the long prompts.
SMALL_BATCH_TOKENS = 8
SMALL_BATCH_TOKENS_LM_HEAD = 4
VNNI_TOKENS = 256


class PackedWeight:
    """A weight-only quantized copy for small batches, built from a checkpoint that was itself quantized.

    int4 uses groups of 32 along the input, as GGUF's Q4 blocks do, so Q4_1 weights are reproduced
    (up to bf16 rounding of the scales); int8 is per output channel. With `vnni` (and a CPU and shape
    that cpu_qgemm supports), int4 runs cpu_qgemm's kernel, whose rows are quantized to int8. With
    `int8_planes` (the tied LM head's Q8_0 weight), int8 runs the same kernel on the weight's groups of 32
    as two 4-bit planes with two activation passes: closer to the Q8_0 weight than the per-channel copy,
    and faster at 1-4 rows (docs/benchmarks.md, issue 35).
    """

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bits: int, max_tokens: int = SMALL_BATCH_TOKENS, vnni: bool = False,
                 passes: int = 1, int8_planes: bool = False):
        self.max_tokens = max_tokens  # used for steps of at most this many tokens
        w = weight.float()
        n, k = w.shape
        self.bits = bits
        self.vnni: Int4VnniWeight | Int8VnniWeight | None = None
        # torch's int4 packing (and cpu_qgemm's tiles) take the output rows in 16s; other layers (uneven
        # tensor-parallel shards, a vocab of 32001) take the per-channel int8 copy below.
        if bits == 4 and k % self.GROUP == 0 and n % 16 == 0:
            g = w.view(n, k // self.GROUP, self.GROUP)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = (hi - lo).clamp(min=1e-8) / 15
            q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.int32).view(n, k)
            if vnni and weight.dtype == torch.bfloat16 and cpu_qgemm.supports(n, k) and cpu_qgemm.available():
                # The weights of torch's int4 kernel below, its bf16 scale and zero (at q = 8) as they are: with two
                # int8 passes the outputs then differ from that kernel's only where the activations' rounding does.
                d = scale.to(torch.bfloat16).float()
                self.vnni = Int4VnniWeight(q, d, (lo + 8 * scale).to(torch.bfloat16).float(), passes, zero_offset=8)
                self.max_tokens = max(max_tokens, VNNI_TOKENS)
                return
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # The kernel computes (q - 8) * scale + zero, so zero = lo + 8 * scale.
            self.scales = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(weight.dtype)
        else:
            self.bits = 8
            if (int8_planes and weight.dtype == torch.bfloat16 and k % self.GROUP == 0
                    and cpu_qgemm.supports(n, 2 * k) and cpu_qgemm.available()):
                self.vnni = Int8VnniWeight(weight)
                return
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            self.packed = (w / scale.unsqueeze(1)).round().clamp(-128, 127).to(torch.int8)
            self.scales = scale.to(weight.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.vnni is not None:
            return self.vnni(x)
        if self.bits == 4:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.GROUP, self.scales)
        return torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)


def _set_weight_loader(param: nn.Parameter, loader, num_shards: int = 1) -> None:
    """num_shards: how many checkpoint tensors fill this parameter (the loader checks each arrived)."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class QKVParallelLinear(LinearBase):
    """Fused q/k/v projection, column-parallel by whole KV-head groups (GQA-correct, uneven allowed)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup):
        super().__init__()
        group = num_heads // num_kv_heads
        if tp.size > num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp.size} exceeds the {num_kv_heads} KV heads")
        kv_start, self.num_kv_heads = piece(num_kv_heads, tp.size, tp.rank)
        self.num_heads = self.num_kv_heads * group
        self.head_dim = head_dim
        # Row ranges of the full checkpoint tensors that this rank owns.
        self.ranges = {
            "q": (kv_start * group * head_dim, self.num_heads * head_dim),
            "k": (kv_start * head_dim, self.num_kv_heads * head_dim),
            "v": (kv_start * head_dim, self.num_kv_heads * head_dim),
        }
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, hidden), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader, 3)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size), requires_grad=False)
            _set_weight_loader(self.bias, self.weight_loader, 3)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert shard_id in self.ranges, shard_id
        offset = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard_id]
        start, size = self.ranges[shard_id]
        src = loaded.narrow(0, start, size)
        dst = param.data.narrow(0, offset, size)
        if dst.shape != src.shape:
            raise ValueError(f"qkv shard {shard_id}: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[T, q_size + 2 * kv_size]: q, k, v side by side (q and k are rotated together)."""
        qkv = self.base(x)
        if self.lora is not None:
            qkv = self.lora.apply(x, qkv)
        return qkv


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input in one matmul (gate and up)."""

    def __init__(self, in_features: int, out_features: list[int], tp: TPGroup):
        super().__init__()
        self.pieces = [piece(n, tp.size, tp.rank) for n in out_features]
        self.offsets = [sum(size for _, size in self.pieces[:i]) for i in range(len(self.pieces))]
        total = sum(size for _, size in self.pieces)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader, len(out_features))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        assert shard_id is not None
        start, size = self.pieces[shard_id]
        src = loaded.narrow(0, start, size)
        dst = param.data.narrow(0, self.offsets[shard_id], size)
        if dst.shape != src.shape:
            raise ValueError(f"merged shard {shard_id}: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        return out if self.lora is None else self.lora.apply(x, out)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products summed with all_reduce."""

    def __init__(self, in_start: int, in_size: int, out_features: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.in_start = in_start
        self.weight = nn.Parameter(torch.empty(out_features, in_size), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        default_weight_loader(param, loaded.narrow(1, self.in_start, param.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.lora is not None:  # before the all_reduce: the LoRA partial sums are reduced with the base's
            out = self.lora.apply(x, out)
        return self.tp.all_reduce(out)


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split evenly (padded) across ranks; lookups outside a shard contribute zeros."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden), requires_grad=False)
        _set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding: expected ({self.vocab_size}, {param.shape[1]}), got {tuple(loaded.shape)}")
        rows = loaded[self.start : self.start + self.shard_size]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(LinearBase):
    """Vocab-parallel output projection; logits are gathered to full width (padding cut off)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, tied_to: VocabParallelEmbedding | None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight  # tied embeddings share one tensor and one loader
        else:
            shard = VocabParallelEmbedding(vocab_size, hidden, tp)
            self.weight = shard.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base(hidden)
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]


def pack_small_batch_weights(model: nn.Module, source_bits: dict[str, int], vnni: bool = True,
                             passes: Callable[[str], int] = lambda name: 2) -> int:
    """Give every linear layer whose checkpoint was 4- or 8-bit a packed copy for small batches (a
    SmallBatchMethod in front of its dense path); with `vnni`, 4-bit layers other than the LM head run
    cpu_qgemm's kernel where the CPU has it, with `passes(layer name)` int8 passes over the activations
    (parallel.cpu.int8_passes_for), and an 8-bit LM head runs it as two 4-bit planes with two passes."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.large_batch_method is None:
            continue
        weight_name = f"{name}.weight"
        bits = source_bits.get(weight_name)
        if bits is None and isinstance(module, ParallelLMHead):
            bits = source_bits.get("embed_tokens.weight")  # tied
        if bits is not None and bits <= 8:
            head = isinstance(module, ParallelLMHead)  # the logits keep bf16 activations
            small = PackedWeight(module.weight.data, 4 if bits <= 4 else 8,
                                 SMALL_BATCH_TOKENS_LM_HEAD if head else SMALL_BATCH_TOKENS, vnni=vnni and not head,
                                 passes=passes(name), int8_planes=vnni and head)
            module.set_method(SmallBatchMethod(small, module.large_batch_method))
            count += 1
    return count


def keep_row_independent_copies(model: nn.Module) -> int:
    """Batch-invariant mode: a row's result must not depend on the step's row count, so no layer may switch
    kernels at a step size. The int4 x int8 VNNI copies compute each row on its own, in exact int32 sums and a
    fixed order (csrc/qgemm.c): they serve every step from now on. The other small-batch copies (torch's int4
    and int8 kernels) are dropped, leaving those layers to their dense path. Returns how many copies serve every
    step."""
    kept = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or not isinstance(module.method, SmallBatchMethod):
            continue
        small = module.method.small
        if isinstance(small, PackedWeight) and small.vnni is not None:
            small.max_tokens = ALL_STEPS
            kept += 1
        else:
            module.set_method(module.method.large)
    return kept


def release_unused_dense_weights(model: nn.Module) -> int:
    """Free the dense weight of each layer whose small-batch copy serves every step (keep_row_independent_copies)
    unless another module shares it (a tied LM head's weight is the embedding); returns how many. Called after
    the weight cache has stored the dense weights it restores from."""
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    released = 0
    for module in model.modules():
        if (isinstance(module, LinearBase) and isinstance(module.method, SmallBatchMethod) and module.method.every_step
                and holders[id(module.weight)] == 1):
            module.release_weight()
            released += 1
    return released


def prepack_onednn_weights(model: nn.Module, batch_invariant: bool = False) -> int:
    """Give every linear layer (and the LM head) with a dense path its weight in oneDNN's layout; see
    OneDNNWeight. Layers whose method serves every batch size (quantized mode, FP8, a copy kept by
    keep_row_independent_copies) run no dense path."""
    count = 0
    for module in model.modules():
        if isinstance(module, LinearBase) and module.large_batch_method is not None:
            module.set_large_batch_method(OneDNNWeight(module.weight.data, batch_invariant))
            count += 1
    return count
