"""Each linear layer's weight method, chosen once its weights are loaded (layers/linear_method.py): FP8 GEMMs
(`model.quantization: fp8`, CUDA), small-batch int4/int8/VNNI copies of a GGUF's quantized layers and oneDNN's
prepacked layout (CPU), as far as the platform offers them. GGUF blocks kept quantized (`model.weights:
quantized`) get theirs while loading (quantized.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from rayllm.layers.linear import (
    ParallelLMHead,
    keep_row_independent_copies,
    pack_small_batch_weights,
    prepack_onednn_weights,
)
from rayllm.layers.linear_method import DenseMethod, LinearBase
from rayllm.platforms.interface import Platform
from rayllm.schema.config import EngineConfig

log = logging.getLogger(__name__)


def quantize_model_fp8(model: nn.Module, keep: tuple[type, ...] = (ParallelLMHead,)) -> int:
    """Every dense linear layer not of a `keep` type (the LM head) to an Fp8Weight, releasing its dense
    weight; returns how many. Dimensions not divisible by 16 stay dense."""
    from rayllm.quant.fp8 import Fp8Weight, fp8_fits

    count = 0
    for module in model.modules():
        if not isinstance(module, LinearBase) or isinstance(module, keep) or not isinstance(module.method, DenseMethod):
            continue
        if not fp8_fits(module.weight):
            log.info("layer with weight %s stays %s (not a multiple of 16)", tuple(module.weight.shape),
                     module.weight.dtype)
            continue
        module.set_method(Fp8Weight.from_dense(module.weight.data))
        count += 1
    return count


def choose_weight_methods(model: nn.Module, config: EngineConfig, platform: Platform, dtype: torch.dtype,
                          source_bits: dict[str, int]) -> None:
    """After load: FP8 when asked (refused where the device has no FP8 GEMMs), then the platform's small-batch
    copies of the layers whose checkpoint was 4- or 8-bit, then its prepacked dense layout."""
    if config.model.quantization == "fp8":
        from rayllm.quant import fp8

        reason = fp8.fp8_refusal(platform.device)
        if reason is not None:
            raise ValueError(reason)
        log.info("FP8 weights in %d layers", quantize_model_fp8(model))
    cpu = config.parallel.cpu
    invariant = config.scheduler.batch_invariant
    # Batch-invariant mode keeps only row-independent copies (auto's VNNI ones), which then serve every step.
    if (cpu.small_batch_quant == "auto" or cpu.small_batch_quant == "weight_only" and not invariant) \
            and platform.small_batch_weights(dtype):
        packed = pack_small_batch_weights(model, source_bits, vnni=cpu.small_batch_quant == "auto",
                                          passes=cpu.int8_passes_for)
        log.info("packed %d layers for small-batch weight-only kernels", packed)
    if invariant:
        log.info("%d layers run their int4 x int8 copy at every step", keep_row_independent_copies(model))
    # Batch-invariant mode needs the prepacked layout: plain F.linear's rows vary with the row count.
    if (cpu.weight_prepack or invariant) and platform.prepacked_gemms(dtype):
        log.info("reordered %d weights into oneDNN's layout", prepack_onednn_weights(model, batch_invariant=invariant))
