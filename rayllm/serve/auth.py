"""API keys: plain or `sha256:<hex>` entries, checked in constant time; a key's digest names its owner."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from rayllm.protocol.errors import APIError, unauthorized

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


def forbidden(message: str) -> APIError:
    return APIError(403, message, type="permission_error", code="admin_key_required")


@dataclass(frozen=True)
class Access:
    """Who may call what: any accepted key for the API, an admin key for routes that change everyone's
    service (loading and unloading adapters), and optionally a key for /metrics.

    Admin keys are accepted keys too. The admin routes are closed (403) until the operator opens them:
    with admin keys (then only those keys), or, with no keys at all (local use), with
    `allow_runtime_lora_updating` (vLLM's switch of the same name).
    """

    keys: KeyRing = KeyRing()
    admins: KeyRing = KeyRing()
    metrics_require_key: bool = False
    admin_open_without_keys: bool = False

    @classmethod
    def from_entries(cls, api_keys: tuple[str, ...] | list[str], admin_keys: tuple[str, ...] | list[str] = (),
                     metrics_require_key: bool = False, allow_runtime_lora_updating: bool = False) -> Access:
        admins = KeyRing.from_entries(admin_keys)
        keys = KeyRing.from_entries(api_keys)
        return cls(KeyRing(keys.digests + admins.digests), admins, metrics_require_key, allow_runtime_lora_updating)

    @property
    def enabled(self) -> bool:
        return self.keys.enabled

    def owner(self, authorization: str | None) -> str:
        return self.keys.owner(authorization)

    def admin(self, authorization: str | None) -> str:
        """The caller's owner id if it holds an admin key; 401 for no valid key, 403 for a non-admin key."""
        owner = self.keys.owner(authorization)
        if not self.keys.enabled:
            if self.admin_open_without_keys:
                return owner
            raise forbidden("this route changes the service for every client and is off: set admin_api_keys, "
                            "or allow_runtime_lora_updating: true on a server without API keys")
        digest = bytes.fromhex(owner)
        ok = False
        for d in self.admins.digests:
            ok |= hmac.compare_digest(digest, d)
        if not ok:
            raise forbidden("this route changes the service for every client: it needs an admin API key "
                            "(admin_api_keys)" if self.admins.enabled else
                            "this route is closed: API keys are on and no admin_api_keys are configured")
        return owner

    def metrics(self, authorization: str | None) -> None:
        if self.metrics_require_key:
            self.keys.owner(authorization)


def cache_salt(owner: str, requested: str | None) -> str | None:
    """The prefix-cache namespace of a request: its key's owner (with keys on) plus the client's own
    `cache_salt`; None (the shared cache) with keys off and no salt asked for."""
    if not owner and requested is None:
        return None
    return f"{owner}\x00{requested or ''}"
