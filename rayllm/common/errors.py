"""One line of an exception for a log line or a client's error message: the first line of its text (Ray's
actor errors and C++ extensions' messages run to many lines), bounded."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's first non-empty line, at most `limit` characters; its type's name when it has no text."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(exc).__name__


def describe(exc: BaseException) -> str:
    """`Type: first line`, without internals beyond the exception's own message."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
