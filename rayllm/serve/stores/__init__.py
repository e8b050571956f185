"""Persistence behind `store` and conversations: stored completions, conversations and responses over SQLite
or PostgreSQL (storage_url).
"""
