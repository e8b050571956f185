"""API keys and admin keys: who may call the routes that change everyone's service, and /metrics."""

from __future__ import annotations

import hashlib

import pytest

from rayllm.protocol.errors import APIError
from rayllm.serve.auth import Access, KeyRing


def bearer(key: str) -> str:
    return f"Bearer {key}"


def status(fn, *args) -> int:
    try:
        fn(*args)
    except APIError as exc:
        return exc.status_code
    return 200


def test_keys_off_leaves_the_api_open_and_the_admin_routes_closed_until_allowed():
    access = Access.from_entries([], [])
    assert not access.enabled
    assert access.owner(None) == ""
    access.metrics(None)
    # Loading or unloading an adapter changes every client's service: closed unless the operator opens it.
    with pytest.raises(APIError) as err:
        access.admin(None)
    assert err.value.status_code == 403 and "allow_runtime_lora_updating" in err.value.message
    opened = Access.from_entries([], [], allow_runtime_lora_updating=True)
    assert opened.admin(None) == ""
    # The switch opens nothing once keys are on: an admin key is still needed.
    keyed = Access.from_entries(["user-key"], [], allow_runtime_lora_updating=True)
    assert status(keyed.admin, bearer("user-key")) == 403


def test_admin_routes_need_an_admin_key():
    admin_digest = "sha256:" + hashlib.sha256(b"root-key").hexdigest()
    access = Access.from_entries(["user-key"], [admin_digest])
    assert status(access.admin, bearer("user-key")) == 403
    assert status(access.admin, bearer("nobody")) == 401
    assert status(access.admin, None) == 401
    assert access.admin(bearer("root-key")) == hashlib.sha256(b"root-key").hexdigest()
    # An admin key is an API key too; the user key's owner id is its digest.
    assert access.owner(bearer("root-key")) == hashlib.sha256(b"root-key").hexdigest()
    assert access.owner(bearer("user-key")) == KeyRing.from_entries(["user-key"]).digests[0].hex()


def test_keys_on_without_admin_keys_closes_admin_routes():
    access = Access.from_entries(["user-key"], [])
    with pytest.raises(APIError) as err:
        access.admin(bearer("user-key"))
    assert err.value.status_code == 403 and "no admin_api_keys" in err.value.message


def test_metrics_key_switch():
    open_metrics = Access.from_entries(["user-key"], [])
    open_metrics.metrics(None)  # default: Prometheus scrapes without a key
    closed = Access.from_entries(["user-key"], [], metrics_require_key=True)
    assert status(closed.metrics, None) == 401
    assert status(closed.metrics, bearer("wrong")) == 401
    closed.metrics(bearer("user-key"))


def test_cache_salt_separates_owners_and_client_salts():
    from rayllm.serve.auth import cache_salt

    assert cache_salt("", None) is None  # keys off, no salt: the shared cache
    salts = {cache_salt("aa", None), cache_salt("bb", None), cache_salt("", "x"), cache_salt("aa", "x")}
    assert len(salts) == 4 and None not in salts
    assert cache_salt("aa", "x") == cache_salt("aa", "x")
