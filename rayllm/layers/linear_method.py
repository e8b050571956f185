"""A linear layer's weight method: how its weight is held and multiplied, chosen once at load.

Every tensor-parallel linear (and the LM head) is a `LinearBase` whose forward is `self.method.apply(self, x)`.
A method is any object with `apply(layer, x)` and `all_batches`: dense (`F.linear` on `layer.weight`), oneDNN's
prepacked layout (platforms/cpu/onednn.py, the LM head's `VocabHalves`), a small-batch int4/int8/VNNI copy in
front of a dense path (`SmallBatchMethod`), or a method with weights of its own for every step size (GGUF blocks
kept quantized, quant/methods.py; FP8, quant/fp8.py), whose layer then holds only its dense weight's shape.
The loader picks each layer's method after its weights are in (loader/weight_methods.py); layers never see
which one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class LinearMethod(Protocol):
    # True when the method serves every step size from weights of its own (the dense weight is released).
    all_batches: bool

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out], with the layer's bias (if any) added."""
        ...


class DenseMethod:
    """The checkpoint's weight as it is: F.linear."""

    all_batches = False

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


DENSE = DenseMethod()


# A small-batch copy's `max_tokens` when it serves every step (layers/linear.keep_row_independent_copies).
ALL_STEPS = 1 << 62


class SmallBatchMethod:
    """A weight-only quantized copy (layers/linear.PackedWeight: int4, int8, or int4 x int8 VNNI) for steps of at
    most `small.max_tokens` tokens, and `large` (dense or oneDNN) for bigger steps; with ALL_STEPS the copy
    serves every step and `large` is never called."""

    all_batches = False

    def __init__(self, small: Callable[[torch.Tensor], torch.Tensor], large: LinearMethod) -> None:
        self.small = small
        self.large = large

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small.max_tokens:  # type: ignore[attr-defined]
            out = self.small(x)
            return out if layer.bias is None else out + layer.bias
        return self.large.apply(layer, x)

    @property
    def every_step(self) -> bool:
        return self.small.max_tokens >= ALL_STEPS  # type: ignore[attr-defined]


class LinearBase(nn.Module):
    """What every parallel linear shares: its weight (and bias), its weight method, and a LoRA slot."""

    weight: nn.Parameter

    def __init__(self) -> None:
        super().__init__()
        self.bias: nn.Parameter | None = None
        self.method: LinearMethod = DENSE
        self.lora = None  # a rayllm.lora.layers.LoRALinear once adapters are attached

    def set_method(self, method: LinearMethod) -> None:
        """Run this layer with `method` from now on; an all-batches method's layer keeps only its weight's shape
        (what reads shapes, such as the LoRA layers, keeps working)."""
        self.method = method
        if method.all_batches:
            self.release_weight()

    def release_weight(self) -> None:
        """Keep only the dense weight's shape (on the meta device), for a method that never reads it."""
        w = self.weight
        self.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)

    @property
    def large_batch_method(self) -> LinearMethod | None:
        """The method of steps beyond a small-batch copy (the whole method without one); None when the layer's
        method has weights of its own for every step size."""
        if isinstance(self.method, SmallBatchMethod):
            return None if self.method.every_step else self.method.large
        return None if self.method.all_batches else self.method

    def set_large_batch_method(self, method: LinearMethod) -> None:
        """Replace the dense path (dense -> oneDNN, oneDNN -> vocabulary halves), keeping a small-batch copy."""
        if self.large_batch_method is None:
            raise ValueError("this layer's weight method serves every step size")
        self.set_method(SmallBatchMethod(self.method.small, method) if isinstance(self.method, SmallBatchMethod)
                        else method)

    def attach_lora(self, lora) -> None:
        """Adapters for this layer (a rayllm.lora.layers.LoRALinear): its delta is added to the base output."""
        self.lora = lora

    def base(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
