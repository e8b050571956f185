"""The stores' tests run each test on SQLite and on PostgreSQL (tests/conftest.py's throwaway server)."""

from __future__ import annotations

import pytest


def fresh_url(request: pytest.FixtureRequest, tmp_path, tables: str) -> str:
    """A database URL for `request.param` ("sqlite" or "postgresql") whose `tables` are empty."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/state/conv.db"
    pg = request.getfixturevalue("postgres_url")
    with __import__("psycopg").connect(pg, autocommit=True) as conn:  # each test gets an empty schema
        conn.execute(f"DROP TABLE IF EXISTS {tables}")
    return pg
