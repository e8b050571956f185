"""Adapter files are size-checked from the safetensors header before any tensor is read."""

from __future__ import annotations

import json
import os
import struct

import pytest

from rayllm.lora.files import LoRAError, max_adapter_bytes, random_peft_adapter, read_peft_adapter
from rayllm.schema.config import LlamaArch

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


def test_fused_modules_load_as_their_parts_with_a_shared_a(tmp_path):
    """Phi-3's PEFT modules qkv_proj / gate_up_proj: one A, and B's rows cut into the parts' outputs."""
    from safetensors.torch import load_file

    path = random_peft_adapter(str(tmp_path / "fused"), ARCH, rank=4, seed=3, targets=("qkv_proj", "gate_up_proj"))
    adapter = read_peft_adapter(path, ARCH, max_rank=8)
    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1"
    scaling = 2.0  # random_peft_adapter's lora_alpha = 2 r
    for fused, parts, block in (("qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn"),
                                ("gate_up_proj", ("gate_proj", "up_proj"), "mlp")):
        a, b = raw[f"{prefix}.{block}.{fused}.lora_A.weight"], raw[f"{prefix}.{block}.{fused}.lora_B.weight"]
        start = 0
        for part in parts:
            part_a, part_b = adapter.weights[(1, part)]
            assert part_a.equal(a)
            assert part_b.equal(b[start : start + part_b.shape[0]] * scaling)
            start += part_b.shape[0]
        assert start == b.shape[0]


def test_a_projection_targeted_alone_and_fused_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = random_peft_adapter(str(tmp_path / "both"), ARCH, rank=4, seed=4, targets=("qkv_proj",))
    other = random_peft_adapter(str(tmp_path / "q"), ARCH, rank=4, seed=5, targets=("q_proj",))
    file = os.path.join(path, "adapter_model.safetensors")
    save_file(load_file(file) | load_file(os.path.join(other, "adapter_model.safetensors")), file)
    with pytest.raises(LoRAError, match="q_proj is targeted both alone and inside a fused projection"):
        read_peft_adapter(path, ARCH, max_rank=8)
