"""FP8 safetensors checkpoints (`quant_method: fp8`) read as dense tensors: weight times scale."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

FP8_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def iter_fp8_dequantized(model_dir: str, files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """A `quant_method: fp8` safetensors checkpoint (e4m3/e5m2 weights with `weight_scale`: per tensor
    or per output channel, or `weight_scale_inv` per 128 x 128 block), as fp32 tensors: weight times
    scale; the scales and activation scales (`input_scale`) themselves are not yielded."""
    from safetensors import safe_open

    handles = [safe_open(os.path.join(model_dir, f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}
    for name, h in where.items():
        # input_scale: static activation scales; k_scale / v_scale: ModelOpt's KV-cache scales.
        if name.endswith(FP8_SCALE_SUFFIXES) or name.endswith((".input_scale", ".k_scale", ".v_scale")):
            continue
        t = h.get_tensor(name)
        if t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            yield name, t
            continue
        base = name.removesuffix(".weight")
        scale_name = next((base + s for s in FP8_SCALE_SUFFIXES if base + s in where), None)
        if scale_name is None:
            raise ValueError(f"{name}: an FP8 weight without {base}.weight_scale")
        w, scale = t.float(), where[scale_name].get_tensor(scale_name).float()
        if scale.dim() == 2 and scale.shape[1] > 1:  # block-wise: [ceil(n / bn), ceil(k / bk)]
            bn, bk = -(-w.shape[0] // scale.shape[0]), -(-w.shape[1] // scale.shape[1])
            scale = scale.repeat_interleave(bn, 0)[: w.shape[0]].repeat_interleave(bk, 1)[:, : w.shape[1]]
        elif scale.numel() == w.shape[0]:
            scale = scale.reshape(-1, 1)
        yield name, w * scale
