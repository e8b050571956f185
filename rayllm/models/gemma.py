"""Gemma 2 and Gemma 3 (text): GeGLU, (1 + w) RMSNorms before and after attention and MLP, embeddings
scaled by sqrt(hidden), query_pre_attn_scalar, sliding-window layers interleaved with global ones,
logit soft-capping (Gemma 2), per-head q/k norms and separate local/global rope bases (Gemma 3).

Sliding-window layers attend to the last `sliding_window` keys only (attention/sdpa.py masks the rest).
Their blocks are not freed (block_manager.py frees only when every layer is windowed): the global
layers interleaved with them read the whole context from the same blocks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rayllm.layers.basic import RotaryEmbedding
from rayllm.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    default_weight_loader,
    piece,
)
from rayllm.models.llama import LlamaForCausalLM
from rayllm.schema.config import LlamaArch

SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32 and cast back, as transformers' Gemma norms."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype)


def _is_gguf(arch: LlamaArch) -> bool:
    return arch.cfg("embedding_length") is not None  # GGUF metadata names, not config.json's


def layer_types(arch: LlamaArch) -> list[str]:
    """config.json's layer_types; else every `pattern`-th layer global (llama.cpp's fixed patterns for
    GGUF: Gemma 2 alternates, Gemma 3 has five local layers per global one)."""
    types = arch.cfg("layer_types")
    if types:
        return list(types)
    default = 2 if arch.model_type == "gemma2" else 6
    pattern = (arch.cfg("sliding_window_pattern") or arch.cfg("_sliding_window_pattern")
               or arch.cfg("attention.sliding_window_pattern") or default)
    if isinstance(pattern, list):  # GGUF may store one flag per layer
        return [SLIDING if flag else FULL for flag in pattern]
    return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(arch.num_layers)]


def rope_by_layer_type(arch: LlamaArch) -> dict[str, tuple[float, dict[str, Any]]]:
    """(theta, scaling) for sliding and global layers."""
    params = arch.cfg("rope_parameters")
    if isinstance(params, dict) and FULL in params:  # transformers 5: one rope dict per layer type
        out = {}
        for kind in (FULL, SLIDING):
            p = dict(params.get(kind) or params[FULL])
            theta = float(p.pop("rope_theta", arch.rope_theta))
            out[kind] = (theta, {} if p.get("rope_type", "default") == "default" else p)
        return out
    scaling = arch.rope_scaling_dict
    if _is_gguf(arch) and arch.cfg("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(arch.cfg("rope.scaling.factor"))}
    if arch.model_type == "gemma2":
        return {FULL: (arch.rope_theta, scaling), SLIDING: (arch.rope_theta, scaling)}
    local = arch.cfg("rope_local_base_freq") or arch.cfg("rope.freq_base_swa") or 10000.0
    return {FULL: (arch.rope_theta, scaling), SLIDING: (float(local), {})}


def query_scale(arch: LlamaArch) -> float:
    scalar = arch.cfg("query_pre_attn_scalar")
    if scalar is None:
        # GGUF does not store it; llama.cpp uses hidden / heads for the 27B models (46 and 62 layers)
        # and the head dim otherwise, which is what their configs say.
        big = arch.num_layers in ((46,) if arch.model_type == "gemma2" else (62,))
        scalar = arch.hidden_size // arch.num_heads if big else arch.head_dim
    return float(scalar) ** -0.5


class GemmaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend, kind: str,
                 window: int | None):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads,
                                          arch.attention_bias, tp)
        group = arch.num_heads // arch.num_kv_heads
        kv_start, _ = piece(arch.num_kv_heads, tp.size, tp.rank)
        self.o_proj = RowParallelLinear(kv_start * group * arch.head_dim, self.qkv_proj.q_size, arch.hidden_size, tp)
        self.rotary = rotary
        self.attn = attn_backend
        self.kind = kind
        self.head_dim = arch.head_dim
        self.qk_norm = arch.model_type != "gemma2"
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps)
        softcap = arch.cfg("attn_logit_softcapping")
        self.attn_options = {"scale": query_scale(arch), "window": window,
                             "softcap": float(softcap) if softcap else None}

    def forward(self, ropes, x, kv_cache, meta):
        qkv = self.qkv_proj(x)
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(t, -1, d)
        k = qkv[:, q_size : q_size + kv_size].view(t, -1, d)
        v = qkv[:, q_size + kv_size :].view(t, -1, d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = ropes[self.kind]
        q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        return self.o_proj(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, **self.attn_options))


class GemmaMLP(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [arch.intermediate_size] * 2, tp)
        in_start, in_size = piece(arch.intermediate_size, tp.size, tp.rank)
        self.down_proj = RowParallelLinear(in_start, in_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend, kind: str,
                 window: int | None):
        super().__init__()
        self.self_attn = GemmaAttention(arch, tp, rotary, attn_backend, kind, window)
        self.mlp = GemmaMLP(arch, tp)
        h, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, ropes, x, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(ropes, self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only)."""

    stacked_params = LlamaForCausalLM.stacked_params
    checkpoint_to_param = LlamaForCausalLM.checkpoint_to_param
    # llama.cpp's names for the four norms of a Gemma block; its q/k rows are not permuted.
    gguf_tensor_names = {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
    }
    torch_attention_only = True  # the C kernel has no window or soft-cap (see attention/sdpa.py)

    def __init__(self, arch: LlamaArch, tp: TPGroup, attn_backend):
        super().__init__()
        self.arch = arch
        self.attn_backend = attn_backend
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, theta, scaling)
            for kind, (theta, scaling) in rope_by_layer_type(arch).items()
        })
        self.layers = nn.ModuleList(GemmaDecoderLayer(arch, tp, self.rotaries[kind], attn_backend, kind, window)
                                    for kind, window in zip(layer_types(arch), self.layer_windows(arch), strict=True))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp,
                                      self.embed_tokens if arch.tie_word_embeddings else None)
        cap = arch.cfg("final_logit_softcapping")
        self.final_softcap = float(cap) if cap else None

    @staticmethod
    def layer_windows(arch: LlamaArch) -> list[int | None]:
        """The sliding layers' window; None for the global layers."""
        window = arch.cfg("sliding_window") or arch.cfg("attention.sliding_window")
        return [int(window) if kind == SLIDING and window else None for kind in layer_types(arch)]

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The normaliser is rounded to the model dtype first, as transformers does.
        x = x * torch.tensor(math.sqrt(self.arch.hidden_size), dtype=x.dtype)
        ropes = {kind: rotary.tables(positions) for kind, rotary in self.rotaries.items()}
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(ropes, x, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def from_gguf(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """llama.cpp stores Gemma's norm weights as 1 + w (its norm multiplies by the weight alone)."""
        return tensor - 1 if name.endswith("norm.weight") else tensor
