"""LoRA adapters as Serve sees them: where adapters come from (adapter_paths), which replica holds which
(adapter_table), and the per-replica registry that loads them into engine slots (lora_registry).
"""
