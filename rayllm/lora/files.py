"""PEFT adapter files: which of our layers each PEFT module targets, reading and checking an adapter
directory (config, safetensors header sizes, shapes against the model), and writing a random one for
tests and benchmarks. The in-engine side (stacked slots, batched deltas) is rayllm/lora/layers.py."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rayllm.schema.config import LlamaArch

if TYPE_CHECKING:  # imported where tensors are read: the model replica validates adapters without torch at start
    import torch

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
# Checkpoints that fuse projections (Phi-3) give PEFT one module for them: one A shared by the parts
# and one B whose rows are the parts' outputs in order. Each part's delta is B_part (A x), so a fused
# module loads as its parts with the same A.
FUSED: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MAX_HEADER_BYTES = 1 << 20  # a full adapter's header (2 x 7 tensors per layer) is a few tens of KB
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
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
    # (layer index, module name; a fused PEFT module split into its parts) -> (A [r, in], B [out, r] with
    # the scaling folded in), full size.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "qkv_proj": (h, q + 2 * kv),
            "gate_up_proj": (h, 2 * i)}


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
    per_layer = sum(fan_in + fan_out for name, (fan_in, fan_out) in module_shapes(arch).items() if name in TARGETS)
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

    from rayllm.layers.moe import sparse_layer_ids

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
                if m is None or (m.group(3) not in TARGETS and m.group(3) not in FUSED):
                    raise LoRAError(f"unsupported tensor {key!r}: only q/k/v/qkv/o/gate/up/gate_up/down_proj LoRA "
                                    "weights")
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
        b = b * scaling  # folded into B once, at load
        start = 0
        for part in FUSED.get(module, (module,)):
            if (layer, part) in weights:
                raise LoRAError(f"layer {layer}: {part} is targeted both alone and inside a fused projection")
            rows = shapes[part][1]
            weights[(layer, part)] = (a, b[start : start + rows])
            start += rows
    return PeftAdapter(rank, weights)



def random_peft_adapter(path: str, arch: LlamaArch, rank: int, seed: int, *, alpha: float | None = None,
                        targets: tuple[str, ...] = tuple(TARGETS), std: float = 0.2) -> str:
    """Write a PEFT-format adapter with fixed-seed random A and B (tests and benchmarks); returns path."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(arch)
    tensors = {}
    for layer in range(arch.num_layers):
        for module in targets:
            fan_in, fan_out = shapes[module]
            block = TARGETS[FUSED.get(module, (module,))[0]][0]
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
