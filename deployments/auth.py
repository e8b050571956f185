"""API keys: plain or `sha256:<hex>` entries, checked in constant time; a key's digest names its owner."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from app.errors import unauthorized

HASH_PREFIX = "sha256:"


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key(entry: str) -> bytes:
    """A configured key as its SHA-256 digest: `sha256:<64 hex>` is taken as given, anything else is hashed."""
    if entry.startswith(HASH_PREFIX):
        hexdigest = entry[len(HASH_PREFIX):].strip().lower()
        try:
            digest = bytes.fromhex(hexdigest)
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"api key entry {entry[:12]}...: expected sha256:<64 hex digits>")
        return digest
    return key_digest(entry)


@dataclass(frozen=True)
class KeyRing:
    """Accepted keys as digests only, so plain and hashed entries compare the same way (and in constant time)."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def from_entries(cls, entries: tuple[str, ...] | list[str]) -> KeyRing:
        return cls(tuple(parse_key(e) for e in entries if e))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def owner(self, authorization: str | None) -> str:
        """The caller's identity (hex digest of its key; "" when auth is off), or a 401 APIError.

        Every entry is compared, whatever matched earlier: the time taken says nothing about which key
        (or how much of one) was right.
        """
        if not self.digests:
            return ""
        header = authorization or ""
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        digest = key_digest(token)
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(digest, d)
        if not token or not ok:
            raise unauthorized()
        return digest.hex()
