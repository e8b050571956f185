"""Tiny random checkpoints of the added families, saved by transformers, and GGUFs written from them.

The weights are random (transformers' own initialisation, seeded): these models test that our
implementation computes what transformers computes, not that they say anything sensible.
The GGUF writer does what llama.cpp's convert_hf_to_gguf.py does for these architectures: the
tensor names come from gguf-py's own name map, experts are stacked per layer
(blk.N.ffn_{gate,up,down}_exps), q/k rows are permuted for llama-arch checkpoints (Mixtral) and
not for Qwen ones, and the same metadata keys are written.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)

# model_type -> config overrides; every one has some layer or option the others lack.
FAMILIES: dict[str, dict] = {
    # Explicit head_dim (32, not hidden / heads = 16), tied embeddings.
    "qwen3": dict(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
    "mixtral": dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    # Shared expert; no renormalisation of the top-k weights (Qwen's default).
    "qwen2_moe": dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False),
    # A dense layer among sparse ones (mlp_only_layers), renormalised top-k weights.
    "qwen3_moe": dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
}

GGUF_ARCH = {"qwen3": "qwen3", "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def make_checkpoint(path, model_type: str, seed: int = 0, **overrides) -> str:
    """A tiny random model of `model_type` saved by transformers' save_pretrained into `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **(COMMON | FAMILIES[model_type] | overrides))
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: q/k rows reordered for its interleaved rotary."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str, out_path: str) -> str:
    """An F32 GGUF of the checkpoint in `model_dir`, as llama.cpp's converter lays it out."""
    import gguf
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as fh:
        hp = json.load(fh)
    model_type = hp["model_type"]
    arch_name = GGUF_ARCH[model_type]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    n_layers = hp["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch, n_layers)
    tensors = load_file(os.path.join(model_dir, "model.safetensors"))

    # Experts: one tensor per projection per layer, stacked over experts (expert 0 first).
    stacked: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            key = ".".join(parts[: i + 1] + parts[i + 2 :])
            experts.setdefault(key, {})[int(parts[i + 1])] = t
        else:
            stacked[name] = t
    for key, per_expert in experts.items():
        stacked[key] = torch.stack([per_expert[e] for e in sorted(per_expert)])

    writer = gguf.GGUFWriter(out_path, arch_name)
    writer.add_block_count(n_layers)
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp["num_key_value_heads"])
    writer.add_rope_freq_base((hp.get("rope_parameters") or {}).get("rope_theta") or hp.get("rope_theta"))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if (n_experts := hp.get("num_local_experts") or hp.get("num_experts")) is not None:
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch_name == "llama":  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    if hp.get("moe_intermediate_size") is not None:  # Qwen2MoeModel.set_gguf_parameters
        writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size") is not None:
        writer.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    # A placeholder vocabulary of the right size (the weights are random; no text is decoded).
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(hp["vocab_size"])])
    writer.add_token_types([gguf.TokenType.NORMAL] * hp["vocab_size"])

    for name, t in stacked.items():
        if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue
        new_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise ValueError(f"llama.cpp has no GGUF name for {name} in {arch_name}")
        if arch_name == "llama" and name.endswith("q_proj.weight"):
            t = _permute(t, hp["num_attention_heads"])
        elif arch_name == "llama" and name.endswith("k_proj.weight"):
            t = _permute(t, hp["num_key_value_heads"])
        writer.add_tensor(new_name, t.float().squeeze().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
