"""The ingress's adapter table: model names -> adapters, lora_path, and the load/unload checks."""

from __future__ import annotations

import pytest

from rayllm.protocol.errors import APIError
from rayllm.serve.lora.adapter_table import AdapterTable

BASE = "SmolLM2-135M-Instruct"


@pytest.fixture
def table() -> AdapterTable:
    return AdapterTable(BASE, {"pirate": "/adapters/pirate"}, created=123)


def test_model_names_address_the_base_or_an_adapter(table):
    assert table.resolve(BASE, None) == (None, None)
    assert table.resolve(None, None) == (None, None)
    assert table.resolve(f"{BASE}:pirate", None) == ("pirate", "/adapters/pirate")
    assert table.resolve("pirate", None) == ("pirate", "/adapters/pirate")
    with pytest.raises(APIError) as err:
        table.resolve("nobody", None)
    assert err.value.status_code == 404 and err.value.code == "model_not_found"


def test_lora_path_loads_on_demand_and_must_agree_with_the_model(tmp_path):
    (tmp_path / "poet").mkdir()
    table = AdapterTable(BASE, {"pirate": "/adapters/pirate"}, created=123, allowed_roots=(str(tmp_path),))
    poet = str(tmp_path / "poet")
    assert table.resolve(BASE, poet) == (poet, poet)  # named by its (canonical) path
    assert table.resolve(BASE, "pirate") == ("pirate", "/adapters/pirate")  # a registered name
    assert table.resolve("pirate", ["/adapters/pirate", "/adapters/pirate"]) == ("pirate", "/adapters/pirate")
    for model, path in (("pirate", "/other"), (BASE, ["/a", "/b"])):
        with pytest.raises(APIError) as err:
            table.resolve(model, path)
        assert err.value.status_code == 400 and err.value.param == "lora_path"


def test_client_paths_are_off_without_allowed_roots(table):
    """Default: no roots, so no request may name a directory (the configured adapter still resolves)."""
    with pytest.raises(APIError) as err:
        table.resolve(BASE, "/etc")
    assert err.value.status_code == 400 and err.value.code == "lora_path_disabled"
    assert table.resolve(BASE, "pirate") == ("pirate", "/adapters/pirate")


def test_paths_outside_the_roots_get_one_uniform_error(tmp_path):
    """Outside the root, `..`, a symlink out, a missing directory, a file: the same 400, so a client
    cannot tell which paths exist."""
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    (root / "file").write_text("x")
    outside = tmp_path / "secret"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    (root / "inner").symlink_to(root / "ok")
    table = AdapterTable(BASE, {}, created=1, allowed_roots=(str(root),))
    assert table.allowed(str(root / "ok")) == str((root / "ok").resolve())
    assert table.allowed(str(root / "inner")) == str((root / "ok").resolve())  # a link that stays inside
    refused = [str(outside), str(root / ".." / "secret"), str(root / "link"), str(root / "missing"),
               str(root / "file"), "/etc", "/nonexistent/dir", "relative/path", "/", str(tmp_path)]
    bodies = set()
    for path in refused:
        with pytest.raises(APIError) as err:
            table.resolve(BASE, path)
        bodies.add(repr(err.value.to_dict()))
        assert err.value.status_code == 400 and err.value.param == "lora_path"
    assert len(bodies) == 1 and "secret" not in bodies.pop()


def test_load_and_unload_checks(table):
    for bad in ("", "a:b", BASE, "pirate"):
        with pytest.raises(APIError) as err:
            table.check_new(bad)
        assert err.value.status_code == 400
    assert table.check_new("poet") == "poet"
    assert table.card("pirate") == {"id": "pirate", "object": "model", "created": 123, "owned_by": "rayllm-tp",
                                    "root": "pirate", "parent": BASE}  # no path on disk
    # A cluster.yaml adapter is configuration: the unload route refuses it (every ingress replica serves it).
    with pytest.raises(APIError) as err:
        table.check_unloadable("pirate")
    assert (err.value.status_code, err.value.param, err.value.code) == (400, "lora_name", "lora_adapter_configured")
    table.check_unloadable("poet")


def test_runtime_adapters_come_and_go_beside_the_configured_ones(table):
    """The store's rows replace the runtime part of the table; a configured name keeps its configured path."""
    table.set_runtime({"poet": "/adapters/poet", "pirate": "/elsewhere"})
    assert table.resolve("poet", None) == ("poet", "/adapters/poet")
    assert table.resolve("pirate", None) == ("pirate", "/adapters/pirate")
    with pytest.raises(APIError) as err:
        table.check_new("poet")
    assert err.value.code == "lora_adapter_exists" and err.value.param == "lora_name"
    table.set_runtime({})
    assert list(table) == ["pirate"]
    with pytest.raises(APIError) as err:
        table.resolve("poet", None)
    assert err.value.status_code == 404 and err.value.code == "model_not_found"


def test_a_remote_source_has_one_spelling_and_must_be_strictly_under_a_root():
    """fsspec reads `x`, `x/` and `x//` as one prefix, and `root//` as the root (tests/loader/test_adapter_sources.py
    shows it against S3): each spelling of an adapter is its canonical one, so one adapter, one download; the
    root itself, an empty, `.` or `..` segment, a query: the uniform 400."""
    table = AdapterTable(BASE, {}, created=1, allowed_roots=("s3://b/adapters/", "hf://my-org/"))
    for spelling in ("s3://b/adapters/x", "s3://b/adapters/x/", "s3://b/adapters/x//", "S3://b/adapters/x///"):
        assert table.resolve(BASE, spelling) == ("s3://b/adapters/x", "s3://b/adapters/x")
    for spelling in ("my-org/y", "hf://my-org/y", "hf://my-org/y/"):
        assert table.resolve(BASE, spelling) == ("hf://my-org/y", "hf://my-org/y")
    assert table.resolve(BASE, "hf://my-org/y@v1")[1] == "hf://my-org/y@v1"
    bodies = set()
    for path in ("s3://b/adapters//", "s3://b/adapters/", "s3://b/adapters", "s3://b/adapters//x", "s3://b/adapters/./x",
                 "s3://b/adapters/x/..", "s3://b/adapters/x?versionId=1", "s3://b/adapters/x#y", "s3://b/adaptersX/x",
                 "hf://my-org/", "hf://my-org//", "hf://my-org/../other/y", "hf://other/y", "my-org", "/etc"):
        with pytest.raises(APIError) as err:
            table.resolve(BASE, path)
        assert err.value.status_code == 400 and err.value.param == "lora_path", path
        bodies.add(repr(err.value.to_dict()))
    assert len(bodies) == 1
