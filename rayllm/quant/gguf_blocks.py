"""A GGUF tensor left in its quantized blocks, as the loader reads it and the quantized weight methods decode
it, and llama.cpp's rotary row order (q/k rows interleaved), which both undo."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF stores q/k rows interleaved for llama.cpp's rotary; undo it to Hugging Face's layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class RawBlocks:
    """A GGUF tensor left in its quantized blocks (`raw_types` of iter_gguf): rows are output features.
    unpermute_heads: q/k rows are in llama.cpp's rotary order; undo with `unpermute_rotary(rows, n)`."""

    data: np.ndarray  # uint8 [rows, bytes per row]
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, int]  # (rows, columns) of the dequantized tensor
    unpermute_heads: int | None
