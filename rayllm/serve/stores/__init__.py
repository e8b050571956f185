"""Persistence behind `store` and conversations: stored completions, conversations and responses over SQLite
or PostgreSQL (storage_url); in the same database, the LoRA adapters loaded at runtime (adapter_store).
"""
