"""Quantized weight methods: GGUF 4-bit groups (with the CPU VNNI kernel when present) and FP8 checkpoints.
"""
