"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) built from the tensor-parallel layers."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rayllm.attention.base import AttentionMetadata
from rayllm.layers.basic import RMSNorm, RotaryEmbedding, silu_and_mul
from rayllm.layers.linear import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    piece,
)
from rayllm.schema.config import LlamaArch


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend, qk_norm: bool = False):
        """qk_norm: per-head RMSNorm of q and k before rotary (Qwen3, Qwen3-MoE)."""
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.attention_bias, tp
        )
        group = arch.num_heads // arch.num_kv_heads
        kv_start, _ = piece(arch.num_kv_heads, tp.size, tp.rank)
        in_start = kv_start * group * arch.head_dim
        self.o_proj = RowParallelLinear(in_start, self.qkv_proj.q_size, arch.hidden_size, tp)
        self.rotary = rotary
        self.attn = attn_backend
        self.head_dim = arch.head_dim
        self.kernels = getattr(attn_backend, "kernels", None)  # C kernels (CPU), or None
        # Per-layer attention options a family sets (e.g. {"window": 2047} for sliding-window layers).
        self.attn_options: dict = {}
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if qk_norm else None

    def forward(self, rope, x, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        qkv = self.qkv_proj.forward(x)
        t, d = x.shape[0], self.head_dim
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if self.q_norm is not None and self.k_norm is not None:  # in place: both rotary paths read qkv
            q_view = qkv[:, :q_size].view(t, -1, d)
            k_view = qkv[:, q_size : q_size + kv_size].view(t, -1, d)
            q_view.copy_(self.q_norm(q_view)[0])
            k_view.copy_(self.k_norm(k_view)[0])
        if self.kernels is not None and qkv.dtype in self.kernels.rotary_dtypes and self.rotary.rotary_dim == d:
            # Rotate q and k in place; q, k and v stay views of qkv, which the kernels read strided.
            self.kernels.rotary_(qkv, (q_size + kv_size) // d, d, rope[0], rope[1])
            q, k, v = qkv.view(t, -1, d).split((q_size // d, kv_size // d, kv_size // d), 1)
        else:
            qk = self.rotary.apply(qkv[:, : q_size + kv_size].view(t, -1, d), rope)  # q and k heads together
            q, k = qk[:, : q_size // d], qk[:, q_size // d :]
            v = qkv[:, q_size + kv_size :].view(t, -1, d)
        o = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta, **self.attn_options)
        return self.o_proj.forward(o)


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup, kernels=None):
        super().__init__()
        self.kernels = kernels
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [arch.intermediate_size] * 2, tp)
        in_start, in_size = piece(arch.intermediate_size, tp.size, tp.rank)
        self.down_proj = RowParallelLinear(in_start, in_size, arch.hidden_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.kernels is not None and gate_up.dtype in self.kernels.fused_dtypes:
            return self.down_proj.forward(self.kernels.silu_and_mul(gate_up))
        return self.down_proj.forward(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend,
                 qk_norm: bool = False, mlp: nn.Module | None = None):
        """mlp: a family's own feed-forward block (a mixture of experts); None for the dense SwiGLU."""
        super().__init__()
        kernels = getattr(attn_backend, "kernels", None)
        self.self_attn = LlamaAttention(arch, tp, rotary, attn_backend, qk_norm)
        self.mlp = mlp if mlp is not None else LlamaMLP(arch, tp, kernels)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)

    def forward(self, rope, x, residual, kv_cache, meta):
        # `.forward`: nn.Module's call machinery (hooks, which the engine never sets) costs ~1 us a
        # call, a few hundred calls a step.
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(rope, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return self.mlp.forward(x), residual


class LlamaForCausalLM(nn.Module):
    # Checkpoint (Hugging Face) name fragment -> (our fused parameter fragment, shard id).
    stacked_params = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    def __init__(self, arch: LlamaArch, tp: TPGroup, attn_backend):
        super().__init__()
        self.arch = arch
        self.attn_backend = attn_backend
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        rotary = self.make_rotary(arch)
        self.rotary = rotary  # one module shared by every layer: its tables are looked up once per step
        self.layers = nn.ModuleList(self.make_layer(i, arch, tp, rotary, attn_backend) for i in range(arch.num_layers))
        windows = self.layer_windows(arch)
        for layer, window in zip(self.layers, windows, strict=True):
            if window is not None:
                layer.self_attn.attn_options["window"] = window
        # Windowed layers take the torch attention path (the C kernel has no window).
        self.torch_attention_only = any(w is not None for w in windows)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, getattr(attn_backend, "kernels", None))
        self.lm_head = ParallelLMHead(
            arch.vocab_size, arch.hidden_size, tp, self.embed_tokens if arch.tie_word_embeddings else None
        )

    @staticmethod
    def make_rotary(arch: LlamaArch) -> RotaryEmbedding:
        """A family with other rope parameters (partial rotary, LongRoPE) overrides this."""
        return RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling_dict)

    @classmethod
    def layer_windows(cls, arch: LlamaArch) -> list[int | None]:
        """Each layer's sliding window (keys within that many positions of the query), None for global
        attention, as transformers reads config.json: the layers `layer_types` names, else the family's
        rule (`windowed_layers`). GGUFs carry no window. A window no shorter than the model's context
        masks nothing and is dropped."""
        n = arch.num_layers
        window = arch.cfg("sliding_window")
        if not window or window >= arch.max_position_embeddings or not cls.uses_sliding_window(arch):
            return [None] * n
        types = arch.cfg("layer_types")
        if types:
            return [int(window) if t == "sliding_attention" else None for t in types]
        return cls.windowed_layers(arch, int(window))

    @staticmethod
    def uses_sliding_window(arch: LlamaArch) -> bool:
        """Mistral, Mixtral and Phi-3 window every layer whenever `sliding_window` is set."""
        return True

    @staticmethod
    def windowed_layers(arch: LlamaArch, window: int) -> list[int | None]:
        return [window] * arch.num_layers

    def make_layer(self, index: int, arch: LlamaArch, tp: TPGroup, rotary: RotaryEmbedding, attn_backend) -> nn.Module:
        """Layer `index`; families override it (q/k norm, a mixture-of-experts MLP)."""
        return LlamaDecoderLayer(arch, tp, rotary, attn_backend)

    def forward(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """Returns final hidden states [T, hidden]; logits are computed only for rows that need them."""
        *_, x = self.forward_pieces(input_ids, positions, kv_caches, meta, 1)
        return x

    def forward_pieces(self, input_ids, positions, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta,
                       pieces: int) -> Iterator[torch.Tensor | None]:
        """forward, paused `pieces - 1` times between layers (None at each pause, the hidden states at the
        end): cuda_graphs.py captures each piece as its own graph, so the GPU starts on the first one
        while the host still launches the rest."""
        x = self.embed_tokens(input_ids)
        residual = None
        rope = self.rotary.tables(positions)
        n = len(self.layers)
        pauses = {n * i // pieces for i in range(1, pieces)}
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer.forward(rope, x, residual, kv, meta)  # see LlamaDecoderLayer.forward
            if i + 1 in pauses:
                yield None
        x, _ = self.norm(x, residual)
        yield x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_to_param(self, name: str) -> tuple[str, str | int | None] | None:
        """Map a Hugging Face tensor name to (our parameter name, shard id); None for tensors we skip."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight":
            return None if self.arch.tie_word_embeddings else ("lm_head.weight", None)
        for frag, (ours, shard) in self.stacked_params.items():
            if frag in name:
                return name.replace(frag, ours), shard
        return name, None
