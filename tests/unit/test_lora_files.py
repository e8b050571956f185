"""Adapter files are size-checked from the safetensors header before any tensor is read."""

from __future__ import annotations

import json
import os
import struct

import pytest

from model_parallel.config import LlamaArch
from model_parallel.lora_files import LoRAError, max_adapter_bytes, random_peft_adapter, read_peft_adapter

# A tiny architecture (no weights needed: only shapes are checked).
ARCH = LlamaArch(hidden_size=96, intermediate_size=128, num_layers=2, num_heads=6, num_kv_heads=3, head_dim=16,
                 vocab_size=300, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                 tie_word_embeddings=False)


def test_a_full_adapter_at_max_rank_fits_the_cap(tmp_path):
    path = random_peft_adapter(str(tmp_path / "ok"), ARCH, rank=8, seed=1)
    assert read_peft_adapter(path, ARCH, max_rank=8).rank == 8
    size = os.path.getsize(os.path.join(path, "adapter_model.safetensors"))
    assert size <= max_adapter_bytes(ARCH, 8) + 64 * 1024  # fp32 at max rank, all seven projections


def _raw(path, header: dict, data: bytes = b"", declared: int | None = None) -> str:
    random_peft_adapter(str(path), ARCH, rank=4, seed=2)  # a valid config, then the file replaced
    blob = json.dumps(header).encode()
    with open(path / "adapter_model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", declared if declared is not None else len(blob)) + blob + data)
    return str(path)


@pytest.mark.parametrize("case", ["oversized", "huge_offsets", "header_past_end", "bad_offsets"])
def test_oversized_or_malformed_files_are_refused_from_the_header(tmp_path, case):
    cap = max_adapter_bytes(ARCH, 8)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    if case == "oversized":  # real bytes beyond what any adapter of rank <= 8 can hold
        n = cap // 4 + 1
        path = _raw(tmp_path / case, {key: {"dtype": "F32", "shape": [n], "data_offsets": [0, n * 4]}},
                    bytes(n * 4))
    elif case == "huge_offsets":  # a header that claims terabytes (the file is tiny)
        path = _raw(tmp_path / case, {key: {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}})
    elif case == "header_past_end":
        path = _raw(tmp_path / case, {}, declared=1 << 40)
    else:
        path = _raw(tmp_path / case, {key: {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})
    with pytest.raises(LoRAError, match="bytes of tensors|header|data_offsets"):
        read_peft_adapter(path, ARCH, max_rank=8)
