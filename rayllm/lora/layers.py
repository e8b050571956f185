"""LoRA adapters: PEFT files, stacked per-slot weights inside the parallel linears, batched deltas.

Every tensor-parallel linear of the decoder (fused qkv, o, fused gate/up, down) gets a `LoRALinear`
holding `[num_slots + 1, ...]` stacked A and B buffers; slot 0 stays zero (the base model). Each
step the model runner tells the shared `LoRABatch` which token rows use which slot; each layer then
adds `B_s (A_s x)` for the rows of every slot in the batch -- the rows gathered per slot into one
padded batched matmul over the stacked weights (as Punica/S-LoRA gather per adapter), or one matmul
when a single adapter covers the step -- with no weight merging and no splitting of the batch per
adapter. A step with only base-model tokens costs one check per layer.

Sharding follows the layer: a column-parallel layer keeps A whole and owns the rows of B that match
its own output slice (per KV-head group for q/k/v, per half for gate/up); a row-parallel layer owns
the columns of A that match its input slice and keeps B whole, and its delta is added before the
layer's all_reduce, so the partial products are summed once, with the base output's.

Layout: the fused layers stack their sub-projections' ranks interleaved (row j*n_sub + i of A is rank
j of sub-projection i), so an adapter of rank r uses the leading r*n_sub rows of its slot, whatever
the padding to max_lora_rank; B uses the same columns, block-diagonal (sub-projection i's output rows
read only its own rank columns).

Batch-invariant mode (`scheduler.batch_invariant`): a row's delta must not depend on the other rows
of the step. The padded bmm (its shapes follow the batch), the fused addmm (one rounding, where the
other paths round the delta first) and plain matmuls (oneDNN's blocking follows the row count) all
break that, so each slot's A and B are laid out once per load like the base weights (OneDNNWeight,
row blocks probed bit-equal to one row at a time), each group's rows run through them, and the
rounded delta is added to its rows only; base rows are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayllm.lora.files import TARGETS, LoRAError, UnknownAdapterError, read_peft_adapter
from rayllm.platforms.cpu.onednn import OneDNNWeight
from rayllm.schema.config import LlamaArch, LoRAConfig


@dataclass
class BmmPlan:
    """One padded batched matmul over the slot range lo..hi (decode-sized steps with several adapters).

    Token rows are gathered into [hi - lo + 1, seg, in] (padding rows read a zero row), and each
    token's delta is read back from its padded position (base tokens read a padding row: zero).
    """

    lo: int
    hi: int
    seg: int
    gather: torch.Tensor  # [(hi - lo + 1) * seg] rows of x padded with one zero row (index T)
    scatter: torch.Tensor  # [T] padded position of each token


class LoRABatch:
    """Which token rows of the current step use which slot; shared by every LoRALinear of a model."""

    def __init__(self) -> None:
        # (slot, the adapter's rank, token rows or None for "every row"); empty = base model only.
        self.groups: list[tuple[int, int, torch.Tensor | None]] = []
        self.plan: BmmPlan | None = None  # set when one padded bmm beats a loop over the groups
        self.max_rank = 0
        self.slots: frozenset[int] = frozenset()
        # CUDA: the step's tokens grouped by slot for the Triton kernels (rayllm/lora/triton_kernels.py).
        self.token_groups = None


class LoRALinear:
    """Stacked adapter weights of one parallel linear (this rank's shard) and its batched delta."""

    def __init__(self, n_sub: int, in_features: int, out_pieces: list[tuple[int, int, int]],
                 in_slice: tuple[int, int] | None, config: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device, batch_invariant: bool = False):
        """out_pieces: per sub-projection (local row offset, start in the full tensor, size).
        in_slice: (start, size) of the full input that this rank owns (row-parallel), else None."""
        self.n_sub = n_sub
        self.out_pieces = out_pieces
        self.in_slice = in_slice
        self.batch = batch
        width = n_sub * config.max_lora_rank
        slots = config.max_loras + 1
        out_local = sum(size for _, _, size in out_pieces)
        # Buffers in the model's dtype: no conversions per layer, and bf16 halves the adapter bytes that
        # a decode step with many adapters reads. On CPU, bf16 GEMMs with a few rows are slow (measured
        # 37 us vs 6.5 us fp32 for [4, 576] x [576, 48]); such steps go through bmm, which is not.
        # B of a fused layer is block-diagonal (sub-projection i reads only its own rank columns): it
        # reads some zeros, but one expand matmul instead of one per sub-projection measured faster
        # (per layer of SmolLM2, 8 adapters of rank 16: 352 us vs 426 us; 1 adapter: 180 vs 242).
        self.a = torch.zeros(slots, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_local, width, dtype=dtype, device=device)
        # Slots whose adapter targets this layer: an adapter of q/v only (PEFT's default) costs nothing
        # in o/gate/up/down.
        self.used: set[int] = set()
        self.batch_invariant = batch_invariant
        self.invariant: dict[int, tuple[OneDNNWeight, OneDNNWeight]] = {}  # slot -> (A, B), batch_invariant only
        # rank * n_sub per slot, 0 where this layer has no adapter: the Triton kernels' only per-slot input.
        self.widths = torch.zeros(slots, dtype=torch.int32, device=device)

    def clear(self, slot: int) -> None:
        self.used.discard(slot)
        self.widths[slot] = 0
        self.invariant.pop(slot, None)
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set(self, slot: int, sub: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [r, in_full], b [out_full, r] (already scaled): keep this rank's shard, interleaved by sub."""
        if self.in_slice is not None:
            a = a[:, self.in_slice[0] : self.in_slice[0] + self.in_slice[1]]
        offset, start, size = self.out_pieces[sub]
        cols = slice(sub, a.shape[0] * self.n_sub, self.n_sub)  # rank j of sub i: row/column j*n_sub+i
        self.a[slot, cols] = a.to(self.a.dtype)
        self.b[slot, offset : offset + size, cols] = b[start : start + size].to(self.b.dtype)
        self.used.add(slot)

    def finish(self, slot: int, rank: int) -> None:
        """After every sub-projection of `slot` is set: its batch-invariant GEMMs, cut to the adapter's rank."""
        if slot in self.used:
            self.widths[slot] = rank * self.n_sub
        if self.batch_invariant and slot in self.used:
            width = rank * self.n_sub
            self.invariant[slot] = (OneDNNWeight(self.a[slot, :width], True), OneDNNWeight(self.b[slot, :, :width].contiguous(), True))

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += B_s A_s x for each slot s in the batch (in place; out is the layer's fresh output)."""
        batch = self.batch
        if batch.token_groups is not None:  # CUDA: two Triton launches, however many adapters
            from rayllm.lora.triton_kernels import lora_apply

            return lora_apply(x, self.a, self.b, out, batch.token_groups, self.widths)
        if not batch.groups or self.used.isdisjoint(batch.slots):
            return out
        if self.batch_invariant:
            for slot, _, rows in batch.groups:
                if slot in self.used:
                    shrink, expand = self.invariant[slot]
                    delta = expand(shrink(x if rows is None else x.index_select(0, rows), None), None)
                    if rows is None:
                        out.add_(delta)
                    else:
                        out.index_add_(0, rows, delta)
            return out
        plan = batch.plan
        if plan is not None:  # four ops, however many adapters are in the step
            width = batch.max_rank * self.n_sub
            lo, hi = plan.lo, plan.hi + 1
            xg = torch.nn.functional.pad(x, (0, 0, 0, 1)).index_select(0, plan.gather).view(hi - lo, plan.seg, -1)
            mid = torch.bmm(xg, self.a[lo:hi, :width].transpose(1, 2))
            delta = torch.bmm(mid, self.b[lo:hi, :, :width].transpose(1, 2))
            out += delta.view(-1, out.shape[1]).index_select(0, plan.scatter)
            return out
        for slot, rank, rows in batch.groups:
            if slot not in self.used:
                continue
            width = rank * self.n_sub  # padding past the adapter's own rank is skipped
            a, b = self.a[slot, :width], self.b[slot, :, :width]
            if rows is None:
                out.addmm_(x @ a.t(), b.t())
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
        return out


class LoRAManager:
    """One per rank: builds the LoRALinears into a model, loads adapters into slots, sets each step's rows."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 batch_invariant: bool = False):
        """batch_invariant: every delta through OneDNNWeight GEMMs (needs oneDNN: CPU, bf16 or fp32)."""
        self.config = config
        self.batch_invariant = batch_invariant
        self.arch: LlamaArch = model.arch  # type: ignore[assignment]
        self.batch = LoRABatch()
        self.device = device
        self.layers = model.layers  # type: ignore[assignment]
        self.id_to_slot: dict[int, int] = {}
        self.slot_rank: dict[int, int] = {}
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj
            qkv.attach_lora(LoRALinear(3, qkv.weight.shape[1], [
                (0, qkv.ranges["q"][0], qkv.q_size),
                (qkv.q_size, qkv.ranges["k"][0], qkv.kv_size),
                (qkv.q_size + qkv.kv_size, qkv.ranges["v"][0], qkv.kv_size),
            ], None, config, self.batch, dtype, device, batch_invariant))
            rows = [attn.o_proj]
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP (a mixture of experts takes no adapters)
                gu = mlp.gate_up_proj
                gu.attach_lora(LoRALinear(2, gu.weight.shape[1], [
                    (off, start, size) for off, (start, size) in zip(gu.offsets, gu.pieces, strict=True)
                ], None, config, self.batch, dtype, device, batch_invariant))
                rows.append(mlp.down_proj)
            for row in rows:
                out_f, in_size = row.weight.shape
                row.attach_lora(LoRALinear(1, in_size, [(0, 0, out_f)], (row.in_start, in_size), config,
                                           self.batch, dtype, device, batch_invariant))

    def load(self, slot: int, lora_id: int, path: str) -> int:
        """Read `path` into `slot` for requests tagged `lora_id`; returns the adapter's rank."""
        if not 1 <= slot <= self.config.max_loras:
            raise LoRAError(f"slot {slot} out of range 1..{self.config.max_loras}")
        adapter = read_peft_adapter(path, self.arch, self.config.max_lora_rank)
        self.unload(slot)
        for (layer_idx, module), (a, b) in adapter.weights.items():
            block, attr, sub = TARGETS[module]
            getattr(getattr(self.layers[layer_idx], block), attr).lora.set(slot, sub, a, b)
        for lin in self._linears():
            lin.finish(slot, adapter.rank)
        self.id_to_slot[lora_id] = slot
        self.slot_rank[slot] = adapter.rank
        return adapter.rank

    def unload(self, slot: int) -> None:
        for lora_id in [i for i, s in self.id_to_slot.items() if s == slot]:
            del self.id_to_slot[lora_id]
        self.slot_rank.pop(slot, None)
        for lin in self._linears():
            lin.clear(slot)

    def _linears(self) -> list[LoRALinear]:
        mods = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None),
                 getattr(layer.mlp, "down_proj", None)) for layer in self.layers]
        return [m.lora for group in mods for m in group if m is not None]

    def bind(self, token_slots: torch.Tensor) -> None:
        """CUDA graphs: the step's slots come from a static device buffer, grouped on the device inside the
        graph; every layer launches its kernels whatever the adapters (a graph cannot branch on them)."""
        from rayllm.lora.triton_kernels import group_tokens

        self.batch.token_groups = group_tokens(token_slots, self.config.max_loras + 1)

    def clear_batch(self) -> None:
        """Every row on the base model: each layer's delta is skipped (no kernel launched)."""
        batch = self.batch
        batch.groups, batch.plan, batch.token_groups = [], None, None
        batch.max_rank, batch.slots = 0, frozenset()

    def set_batch(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Per sequence: its adapter id (0 = base) and its token count this step, in batch order."""
        unknown = {i for i in lora_ids if i and i not in self.id_to_slot}
        if unknown:  # checked before any state changes: the batch is left as it was
            raise UnknownAdapterError(unknown)
        groups: dict[int, list[int]] = {}
        offset = 0
        for lora_id, n in zip(lora_ids, num_tokens, strict=True):
            if lora_id:
                groups.setdefault(self.id_to_slot[lora_id], []).extend(range(offset, offset + n))
            offset += n
        batch = self.batch
        dev = self.device
        batch.groups = [
            (slot, self.slot_rank[slot], None if len(rows) == offset else torch.tensor(rows, device=dev))
            for slot, rows in groups.items()
        ]
        batch.max_rank = max((self.slot_rank[slot] for slot in groups), default=0)
        batch.slots = frozenset(groups)
        batch.plan = None
        batch.token_groups = None
        if dev.type == "cuda" and groups:
            from rayllm.lora.triton_kernels import group_tokens

            slots = [0] * offset
            for slot, rows in groups.items():
                for row in rows:
                    slots[row] = slot
            batch.token_groups = group_tokens(torch.tensor(slots, dtype=torch.int32, device=dev),
                                              self.config.max_loras + 1)
            return
        if self.batch_invariant:  # one GEMM pair per adapter, never the padded bmm
            return
        if len(groups) > 1 or any(len(rows) < offset for rows in groups.values()):
            lo, hi = min(groups), max(groups)
            longest = max(len(rows) for rows in groups.values())
            lora_tokens = sum(len(r) for r in groups.values())
            seg = longest
            if (hi - lo + 1) * seg == lora_tokens and lora_tokens < offset:
                seg += 1  # base tokens read their (zero) delta from a padding row: make sure one exists
            padded = (hi - lo + 1) * seg
            # One padded bmm costs a few ops per layer instead of four per adapter; worth it unless the
            # padding would dwarf the real rows (a long prefill beside short decodes).
            if padded <= 2 * offset + 64:
                gather = [offset] * padded
                scatter = [-1] * offset
                for slot, rows in groups.items():
                    base = (slot - lo) * seg
                    gather[base : base + len(rows)] = rows
                    for j, row in enumerate(rows):
                        scatter[row] = base + j
                if lora_tokens < offset:
                    pad_pos = gather.index(offset)
                    scatter = [pad_pos if p < 0 else p for p in scatter]
                batch.plan = BmmPlan(lo, hi, seg, torch.tensor(gather, device=dev), torch.tensor(scatter, device=dev))
