"""Loading a GGUF with its quantized linear weights kept quantized (`model.weights: quantized`): each layer's
blocks are decoded into the weight methods of rayllm.quant.methods through the layer's own weight_loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from rayllm.layers.linear import ParallelLMHead, RowParallelLinear
from rayllm.layers.linear_method import LinearBase
from rayllm.loader.loader import iter_gguf
from rayllm.loader.model_sources import is_gguf
from rayllm.quant.gguf_blocks import RawBlocks, unpermute_rotary
from rayllm.quant.methods import (
    INT4_TYPES,
    QK_K,
    QUANT_TYPES,
    Int4GroupWeight,
    Int8GroupWeight,
    decode_blocks,
)


class _Slot:
    """Stand-in parameter for a layer's own weight_loader: it slices rows/columns as for the dense weight."""

    def __init__(self, data: torch.Tensor):
        self.data, self.shape = data, data.shape


@dataclass
class _Pending:
    q: torch.Tensor
    scale: torch.Tensor  # per 16 columns: the finest group of any supported type
    zero: torch.Tensor
    int4: bool = True
    parts: int = 0
    groups: set[int] = field(default_factory=set)


def _fill(module: nn.Module, loader, pend: _Pending, raw: RawBlocks, shard) -> None:
    """loader: the dense parameter's weight_loader, applied to the values and to the group tensors."""
    q, scale, zero, g = decode_blocks(raw)
    pend.int4 &= raw.qtype.name in INT4_TYPES  # type: ignore[attr-defined]
    pend.groups.add(g)
    scale, zero = (t.repeat_interleave(g // 16, 1) for t in (scale, zero))
    loader(_Slot(pend.q), q, shard)
    for dst, src in ((pend.scale, scale), (pend.zero, zero)):
        if isinstance(module, RowParallelLinear):  # its loader cuts input columns: cut groups here
            if module.in_start % 32:
                raise ValueError("weights: quantized needs tensor-parallel input splits at multiples of 32")
            dst.copy_(src.narrow(1, module.in_start // 16, dst.shape[1]))
        else:
            loader(_Slot(dst), src, shard)
    pend.parts += 1


def _finish(module: LinearBase, pend: _Pending, dtype: torch.dtype, int8_activations: bool, passes: int) -> None:
    """The layer's weight method from its decoded blocks; the layer keeps no dense copy, only its shape."""
    if pend.int4 and pend.groups == {32}:
        module.set_method(Int4GroupWeight(pend.q, pend.scale[:, ::2], pend.zero[:, ::2], dtype, int8_activations,
                                          passes))
    else:
        step = 1 if 16 in pend.groups else 2
        module.set_method(Int8GroupWeight(pend.q, pend.scale[:, ::step], pend.zero[:, ::step], dtype))


def load_quantized_weights(model: nn.Module, path: str, int8_activations: bool = False,
                           passes: Callable[[str], int] = lambda name: 2) -> int:
    """Load a GGUF keeping its supported quantized linear weights quantized; everything else (norms,
    the embedding, a tied LM head, other types) dense as `loader.load_weights` does. Returns the
    number of layers kept quantized. int8_activations: 4-bit layers run cpu_qgemm's kernel where they can."""
    if not is_gguf(path):
        raise ValueError("model.weights: quantized needs a GGUF checkpoint")
    from rayllm.loader.gguf_file import dequantize

    arch = model.arch  # type: ignore[attr-defined]
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: dict[str, int] = {}
    pending: dict[str, _Pending] = {}
    dtype = next(iter(params.values())).dtype
    extra = getattr(model, "gguf_tensor_names", None)
    for name, tensor in iter_gguf(path, arch, None, extra, raw_types=QUANT_TYPES):
        target = model.checkpoint_to_param(name)  # type: ignore[operator]
        if target is None:
            continue
        param_name, shard = target
        if param_name not in params:
            raise ValueError(f"unexpected tensor in checkpoint: {name}")
        mod_name = param_name.rpartition(".")[0]
        module = modules[mod_name]
        quantizable = (isinstance(tensor, RawBlocks) and param_name.endswith(".weight") and isinstance(module, LinearBase)
                       and not (isinstance(module, ParallelLMHead) and arch.tie_word_embeddings))
        if quantizable and tensor.shape[1] % QK_K and tensor.qtype.name.endswith("_K"):  # type: ignore[union-attr]
            quantizable = False
        if quantizable:
            pend = pending.get(mod_name)
            if pend is None:
                n, k = module.weight.shape
                pend = pending[mod_name] = _Pending(torch.empty(n, k, dtype=torch.int8),
                                                    torch.zeros(n, k // 16), torch.zeros(n, k // 16))
            _fill(module, params[param_name].weight_loader, pend, tensor, shard)  # type: ignore[arg-type]
            if pend.parts == getattr(params[param_name], "num_shards", 1):
                _finish(module, pending.pop(mod_name), dtype, int8_activations, passes(mod_name))
        else:
            if isinstance(tensor, RawBlocks):
                if mod_name in pending:
                    raise ValueError(f"{name}: a fused layer mixes quantized and dense parts")
                w = dequantize(tensor.data, tensor.qtype).reshape(tensor.shape)
                t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
                tensor = unpermute_rotary(t, tensor.unpermute_heads) if tensor.unpermute_heads else t
            params[param_name].weight_loader(params[param_name], tensor.to(dtype), shard)  # type: ignore[attr-defined]
        loaded[param_name] = loaded.get(param_name, 0) + 1
    missing = [n for n, p in params.items() if loaded.get(n, 0) != getattr(p, "num_shards", 1)]
    missing = [n for n in missing if not (isinstance(getattr(modules.get(n.rpartition(".")[0]), "method", None),
                                                     (Int4GroupWeight, Int8GroupWeight)))]
    if missing or pending:
        raise ValueError(f"parameters missing from checkpoint (or loaded partially): {(missing + list(pending))[:10]}")
    return sum(isinstance(getattr(m, "method", None), (Int4GroupWeight, Int8GroupWeight)) for m in model.modules())
