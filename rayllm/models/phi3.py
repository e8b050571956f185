"""Phi-3 / Phi-4 (Phi3ForCausalLM): a Llama decoder whose checkpoint fuses qkv_proj and gate_up_proj,
with LongRoPE ("su") scaling, partial rotary (Phi-4-mini) and an optional sliding window (Phi-3-mini).

A sliding window on every layer keeps attention within it (attention/sdpa.py), and the blocks that fall
behind it go back to the pool (block_manager.py).
"""

from __future__ import annotations

from torch import nn

from rayllm.layers.basic import RotaryEmbedding
from rayllm.layers.linear import TPGroup
from rayllm.models.llama import LlamaForCausalLM
from rayllm.schema.config import LlamaArch


def _split_rows(param: nn.Parameter, pieces: list[tuple[str | int, int]]) -> None:
    """Let a fused checkpoint tensor fill a parameter that TP-shards each of its parts: cut it into
    its parts by rows and hand each to the parameter's own per-part loader."""
    per_part = param.weight_loader  # type: ignore[attr-defined]

    def load(p: nn.Parameter, loaded, shard_id=None) -> None:
        start = 0
        for part, rows in pieces:
            per_part(p, loaded.narrow(0, start, rows), part)
            start += rows
        if start != loaded.shape[0]:
            raise ValueError(f"fused tensor has {loaded.shape[0]} rows, expected {start}")

    param.weight_loader = load  # type: ignore[attr-defined]
    param.num_shards = 1  # type: ignore[attr-defined]


def _is_gguf(arch: LlamaArch) -> bool:
    return arch.cfg("embedding_length") is not None


class Phi3ForCausalLM(LlamaForCausalLM):
    gguf_tensor_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

    def __init__(self, arch: LlamaArch, tp: TPGroup, attn_backend):
        super().__init__(arch, tp, attn_backend)
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        for layer in self.layers:
            _split_rows(layer.self_attn.qkv_proj.weight, [("q", q), ("k", kv), ("v", kv)])
            _split_rows(layer.mlp.gate_up_proj.weight, [(0, arch.intermediate_size), (1, arch.intermediate_size)])

    @staticmethod
    def layer_windows(arch: LlamaArch) -> list[int | None]:
        if not _is_gguf(arch):
            return LlamaForCausalLM.layer_windows(arch)
        window = arch.cfg("attention.sliding_window")
        return [int(window) if window and window < arch.max_position_embeddings else None] * arch.num_layers

    @staticmethod
    def make_rotary(arch: LlamaArch) -> RotaryEmbedding:
        if _is_gguf(arch):
            rotary_dim = int(arch.cfg("rope.dimension_count", arch.head_dim))
            scaling = {}
            if arch.cfg("rope_factors_long"):
                scaling = {"rope_type": "longrope", "long_factor": arch.cfg("rope_factors_long"),
                           "short_factor": arch.cfg("rope_factors_short"),
                           "original_max_position_embeddings": int(arch.cfg("rope.scaling.original_context_length")),
                           "attention_factor": arch.cfg("rope.scaling.attn_factor")}
        else:
            params = dict(arch.cfg("rope_parameters") or arch.cfg("rope_scaling") or {})
            partial = params.get("partial_rotary_factor") or arch.cfg("partial_rotary_factor", 1.0)
            rotary_dim = int(arch.head_dim * partial)
            scaling = dict(arch.rope_scaling_dict)
            scaling.pop("partial_rotary_factor", None)
            if scaling:
                scaling.setdefault("original_max_position_embeddings", arch.cfg("original_max_position_embeddings"))
        return RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, scaling, rotary_dim)

    def checkpoint_to_param(self, name: str) -> tuple[str, str | int | None] | None:
        if name.startswith("rope_factors_"):  # GGUF's LongRoPE factors: read with the metadata
            return None
        if ".qkv_proj." in name or ".gate_up_proj." in name:
            return name.removeprefix("model."), None
        return super().checkpoint_to_param(name)
