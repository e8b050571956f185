"""The ingress's adapter table: model names -> adapters, lora_path, and the load/unload checks."""

from __future__ import annotations

import pytest

from app.errors import APIError
from deployments.adapter_table import AdapterTable

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


def test_lora_path_loads_on_demand_and_must_agree_with_the_model(table):
    assert table.resolve(BASE, "/elsewhere") == ("/elsewhere", "/elsewhere")  # named by its path
    assert table.resolve(BASE, "pirate") == ("pirate", "/adapters/pirate")  # a registered name
    assert table.resolve("pirate", ["/adapters/pirate", "/adapters/pirate"]) == ("pirate", "/adapters/pirate")
    for model, path in (("pirate", "/other"), (BASE, ["/a", "/b"])):
        with pytest.raises(APIError) as err:
            table.resolve(model, path)
        assert err.value.status_code == 400 and err.value.param == "lora_path"


def test_load_and_unload_checks(table):
    for bad in ("", "a:b", BASE, "pirate"):
        with pytest.raises(APIError) as err:
            table.check_new(bad)
        assert err.value.status_code == 400
    assert table.check_new("poet") == "poet"
    assert table.card("pirate") == {"id": "pirate", "object": "model", "created": 123, "owned_by": "rayllm-tp",
                                    "root": "/adapters/pirate", "parent": BASE}
    assert table.remove("pirate") == "pirate" and "pirate" not in table and list(table) == []
    with pytest.raises(APIError) as err:
        table.remove("pirate")
    assert err.value.status_code == 404 and err.value.code == "lora_adapter_not_found"
