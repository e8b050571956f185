"""Tensor-parallel building blocks: column / row / QKV / merged linears with their weight handling, vocabulary
embedding and LM head, RMSNorm, rotary embedding, SiLU-and-mul, fused mixture of experts.
"""
