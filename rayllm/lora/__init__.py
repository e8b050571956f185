"""LoRA: reading PEFT adapters (files) and the adapter slots with their batched deltas inside the TP linears
(layers).
"""
