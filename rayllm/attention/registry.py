"""The attention backends by name, as the model registry lists families: a backend is one file in this folder
plus one line here, and only the backend in use is imported (xformers and triton need CUDA). No torch here:
the serve config checks names against this table in processes that never load torch."""

from __future__ import annotations

# name -> "module:Class"; a class takes no arguments (on CPU, selector passes the C kernels to sdpa).
BACKENDS: dict[str, str] = {
    "sdpa": "rayllm.attention.sdpa:SDPAAttention",
    "triton": "rayllm.attention.triton_prefill:TritonPrefillAttention",
    "xformers": "rayllm.attention.xformers:XformersAttention",
}
# What `auto` tries on CUDA, in order (the Triton kernels measured fastest on a GPU, docs/benchmarks.md).
CUDA_AUTO = ("triton", "xformers")
