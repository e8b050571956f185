"""Tiny models with RANDOM weights, built by transformers for the Triton-interpreter engine tests.

The interpreter runs each kernel launch in Python, so a test's cost grows with layers x launches: these
models keep the default model's attention shape (head dim 64, grouped KV heads) in two layers.
"""

from __future__ import annotations

import torch

VOCAB = 256


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


def tiny(path, family: str) -> str:
    """Random weights (transformers' init, random norm weights so Gemma's (1 + w) matters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=8)
    if family == "gemma2":
        cfg = AutoConfig.for_model("gemma2", **common, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=5.0, final_logit_softcapping=5.0)
    elif family == "mistral":
        cfg = AutoConfig.for_model("mistral", **common, num_hidden_layers=2)
    else:  # llama with the default model's head dim and KV grouping; a wide init so greedy picks are clear in fp16
        cfg = AutoConfig.for_model("llama", hidden_size=192, intermediate_size=256, num_attention_heads=3,
                                   num_key_value_heads=1, num_hidden_layers=2, vocab_size=VOCAB,
                                   max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if family == "llama" else 0.0, 0.3)
    model.save_pretrained(str(path))
    return str(path)
