"""LoRA adapters as Serve sees them: where adapters come from (adapter_paths), which replica holds which
(adapter_table), the runtime-loaded ones every ingress replica shares through the store (shared_adapters),
and the per-replica registry that loads them into engine slots (lora_registry).
"""
