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
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from model_parallel.config import LlamaArch, LoRAConfig
from model_parallel.moe import sparse_layer_ids

# PEFT module name -> (attribute path of our parallel layer, index of the sub-projection in it).
TARGETS: dict[str, tuple[str, str, int]] = {
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
MAX_HEADER_BYTES = 1 << 20  # a full adapter's header (2 x 7 tensors per layer) is a few tens of KB
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
MOE_LORA_UNSUPPORTED = ("LoRA on mixture-of-experts MLPs (routed or shared experts, router) is not supported; "
                        "target the attention projections (q_proj, k_proj, v_proj, o_proj)")


class LoRAError(ValueError):
    """An adapter that cannot be used with this model (unreadable, mismatched, unsupported)."""


class UnknownAdapterError(LoRAError):
    """A step named adapter ids that are not loaded: the fault of the sequences carrying them (their
    adapter was unloaded under them), not of the engine. `lora_ids` lets the engine fail just those."""

    def __init__(self, lora_ids: set[int]):
        super().__init__(f"adapter ids {sorted(lora_ids)} are not loaded on this rank")
        self.lora_ids = frozenset(lora_ids)


@dataclass
class PeftAdapter:
    rank: int
    # (layer index, PEFT module name) -> (A [r, in], B [out, r] with the scaling folded in), full size.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_peft_config(path: str) -> dict:
    """adapter_config.json, checked for the LoRA variants we implement; raises LoRAError."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter directory {path!r} does not exist")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"{path!r} has no adapter_config.json (not a PEFT adapter)")
    if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            # Pickled .bin files can run code when loaded; we only read safetensors.
            raise LoRAError(f"{path!r} holds adapter_model.bin: only adapter_model.safetensors is accepted "
                            "(convert it with safetensors.torch.save_file)")
        raise LoRAError(f"{path!r} has no adapter_model.safetensors")
    try:
        if os.path.getsize(cfg_path) > MAX_HEADER_BYTES:
            raise LoRAError(f"adapter_config.json in {path!r} is too large")
        with open(cfg_path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"unreadable adapter_config.json in {path!r}: {exc}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path!r} is not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    unsupported = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "per-module ranks",
        "alpha_pattern": "per-module alphas", "fan_in_fan_out": "fan_in_fan_out",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAError(f"{what} adapters are not supported ({key} is set in {path!r})")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA bias training ({cfg.get('bias')!r}) is not supported")
    if not isinstance(cfg.get("r"), int) or cfg["r"] < 1:
        raise LoRAError(f"adapter_config.json in {path!r} has no valid rank r")
    return cfg


def max_adapter_bytes(arch: LlamaArch, max_rank: int) -> int:
    """The largest tensor data a usable adapter can hold: every target module of every layer at max_rank, fp32."""
    per_layer = sum(fan_in + fan_out for fan_in, fan_out in module_shapes(arch).values())
    return arch.num_layers * per_layer * max_rank * 4


def check_safetensors_header(file: str, arch: LlamaArch, max_rank: int) -> None:
    """Sizes from the header alone, before any tensor is read: a huge or malformed file is refused
    without being loaded into memory."""
    cap = max_adapter_bytes(arch, max_rank)
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(MAX_HEADER_BYTES, size - 8):
                raise LoRAError("adapter_model.safetensors has no valid header")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        raise LoRAError(f"unreadable adapter_model.safetensors: {exc}") from None
    total = 0
    for key, info in (header.items() if isinstance(header, dict) else [("?", None)]):
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if key != "__metadata__" and not (isinstance(offsets, list) and len(offsets) == 2
                                          and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise LoRAError(f"adapter_model.safetensors: tensor {key[:80]!r} has no valid data_offsets")
        total += offsets[1] - offsets[0] if key != "__metadata__" else 0
    if total > cap or size - 8 - n > cap:
        raise LoRAError(f"adapter_model.safetensors holds {max(total, size - 8 - n)} bytes of tensors; an adapter "
                        f"of rank <= {max_rank} for this model holds at most {cap}")


def read_peft_adapter(path: str, arch: LlamaArch, max_rank: int) -> PeftAdapter:
    """Read and validate a PEFT LoRA adapter against the base model; raises LoRAError."""
    from safetensors import SafetensorError, safe_open

    cfg = read_peft_config(path)
    rank = cfg["r"]
    if rank > max_rank:
        raise LoRAError(f"adapter rank {rank} exceeds this server's max_lora_rank {max_rank}")
    check_safetensors_header(os.path.join(path, "adapter_model.safetensors"), arch, max_rank)
    alpha = cfg.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes = module_shapes(arch)
    sparse = sparse_layer_ids(arch)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as fh:
            for key in fh.keys():
                m = _KEY.search(key)
                if m is None and re.search(r"\.(experts|shared_expert|block_sparse_moe)\.|\.shared_expert_gate\.", key):
                    raise LoRAError(f"unsupported tensor {key!r}: {MOE_LORA_UNSUPPORTED}")
                if m is None or m.group(3) not in TARGETS:
                    raise LoRAError(f"unsupported tensor {key!r}: only q/k/v/o/gate/up/down_proj LoRA weights")
                layer, module = int(m.group(1)), m.group(3)
                if layer >= arch.num_layers:
                    raise LoRAError(f"{key!r}: layer {layer} but the base model has {arch.num_layers} layers")
                if layer in sparse and module in _MLP_TARGETS:
                    raise LoRAError(f"{key!r}: layer {layer} is a mixture of experts: {MOE_LORA_UNSUPPORTED}")
                pairs.setdefault((layer, module), {})[m.group(4)] = fh.get_tensor(key)
    except SafetensorError as exc:
        raise LoRAError(f"unreadable adapter_model.safetensors in {path!r}: {exc}") from None
    if not pairs:
        raise LoRAError(f"{path!r} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"].float(), ab["B"].float()
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"model (expected ({rank}, {fan_in}) / ({fan_out}, {rank})): an adapter for another model?")
        weights[(layer, module)] = (a, b * scaling)  # scaling folded into B once, at load
    return PeftAdapter(rank, weights)


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


class LoRALinear:
    """Stacked adapter weights of one parallel linear (this rank's shard) and its batched delta."""

    def __init__(self, n_sub: int, in_features: int, out_pieces: list[tuple[int, int, int]],
                 in_slice: tuple[int, int] | None, config: LoRAConfig, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device):
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

    def clear(self, slot: int) -> None:
        self.used.discard(slot)
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

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += B_s A_s x for each slot s in the batch (in place; out is the layer's fresh output)."""
        batch = self.batch
        if not batch.groups or self.used.isdisjoint(batch.slots):
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

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.arch: LlamaArch = model.arch  # type: ignore[assignment]
        self.batch = LoRABatch()
        self.device = device
        self.layers = model.layers  # type: ignore[assignment]
        self.id_to_slot: dict[int, int] = {}
        self.slot_rank: dict[int, int] = {}
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_proj
            qkv.lora = LoRALinear(3, qkv.weight.shape[1], [
                (0, qkv.ranges["q"][0], qkv.q_size),
                (qkv.q_size, qkv.ranges["k"][0], qkv.kv_size),
                (qkv.q_size + qkv.kv_size, qkv.ranges["v"][0], qkv.kv_size),
            ], None, config, self.batch, dtype, device)
            rows = [attn.o_proj]
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP (a mixture of experts takes no adapters)
                gu = mlp.gate_up_proj
                gu.lora = LoRALinear(2, gu.weight.shape[1], [
                    (off, start, size) for off, (start, size) in zip(gu.offsets, gu.pieces, strict=True)
                ], None, config, self.batch, dtype, device)
                rows.append(mlp.down_proj)
            for row in rows:
                out_f, in_size = row.weight.shape
                row.lora = LoRALinear(1, in_size, [(0, 0, out_f)], (row.in_start, in_size), config, self.batch,
                                      dtype, device)

    def load(self, slot: int, lora_id: int, path: str) -> int:
        """Read `path` into `slot` for requests tagged `lora_id`; returns the adapter's rank."""
        if not 1 <= slot <= self.config.max_loras:
            raise LoRAError(f"slot {slot} out of range 1..{self.config.max_loras}")
        adapter = read_peft_adapter(path, self.arch, self.config.max_lora_rank)
        self.unload(slot)
        for (layer_idx, module), (a, b) in adapter.weights.items():
            block, attr, sub = TARGETS[module]
            getattr(getattr(self.layers[layer_idx], block), attr).lora.set(slot, sub, a, b)
        self.id_to_slot[lora_id] = slot
        self.slot_rank[slot] = adapter.rank
        return adapter.rank

    def unload(self, slot: int) -> None:
        for lora_id in [i for i, s in self.id_to_slot.items() if s == slot]:
            del self.id_to_slot[lora_id]
        self.slot_rank.pop(slot, None)
        for layer in self.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, getattr(layer.mlp, "gate_up_proj", None),
                        getattr(layer.mlp, "down_proj", None)):
                if lin is not None:
                    lin.lora.clear(slot)

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


def random_peft_adapter(path: str, arch: LlamaArch, rank: int, seed: int, *, alpha: float | None = None,
                        targets: tuple[str, ...] = tuple(TARGETS), std: float = 0.2) -> str:
    """Write a PEFT-format adapter with fixed-seed random A and B (tests and benchmarks); returns path."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            block = TARGETS[module][0]
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha or 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False, "base_model_name_or_path": None}
    with open(os.path.join(path, "adapter_config.json"), "w") as fh:
        json.dump(config, fh)
    return path
