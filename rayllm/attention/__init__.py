"""Attention backends over the paged KV cache: torch SDPA (reference, sliding windows, soft-capping), the C
kernels on CPU, xformers and Triton on CUDA; each backend builds its own metadata.
"""
