"""The ingress's model table (rayllm/serve/routes/model_routes.py): which base model a request's `model` names.
Lookup only: the deployment handles are never called here, so none are bound (None)."""

from __future__ import annotations

import pytest

from rayllm.protocol.errors import APIError
from rayllm.serve.config import ServerConfig
from rayllm.serve.routes.model_routes import ModelRoutes


@pytest.fixture()
def routes() -> ModelRoutes:
    config = ServerConfig.from_args({"models": [
        {"served_model_name": "base", "aliases": ["b"], "engine": {"lora": {"max_loras": 1, "adapters": {"sql": "/a/sql"}}}},
        {"served_model_name": "tiny", "aliases": ["t", "small"], "engine": {"lora": {"max_loras": 1, "adapters": {"poem": "/a/p"}}}},
    ]})
    return ModelRoutes(config.models, {"base": None, "tiny": None}, None, created=0)


@pytest.mark.parametrize("model, expected, adapter", [
    (None, "base", None), ("base", "base", None), ("b", "base", None), ("tiny", "tiny", None),
    ("small", "tiny", None), ("base:sql", "base", "sql"), ("b:sql", "base", "sql"), ("t:poem", "tiny", "poem"),
    ("poem", "tiny", "poem"),  # an adapter's own name finds its base model
])
def test_model_names_aliases_and_adapters_route(routes, model, expected, adapter):
    route = routes.find(model)
    assert route.name == expected
    assert (route.adapters.resolve(model, None)[0] if model else None) == adapter


def test_unknown_model_is_a_404_naming_the_available_ones(routes):
    for model in ("nope", "nope:sql"):
        with pytest.raises(APIError) as err:
            routes.find(model)
        assert err.value.status_code == 404 and err.value.code == "model_not_found" and err.value.param == "model"
        assert str(err.value.message).endswith("Available models: b, base, small, t, tiny")
    with pytest.raises(APIError) as err:  # a known model, an adapter it does not have
        routes.find("tiny:sql").adapters.resolve("tiny:sql", None)
    assert err.value.status_code == 404


def test_select_is_per_request_context(routes):
    import asyncio

    async def request(model: str) -> str:
        routes.select(model)
        await asyncio.sleep(0)  # another request selects meanwhile
        return routes.current.name

    async def both() -> list[str]:
        return await asyncio.gather(request("t"), request("b"), request("tiny"))

    assert asyncio.run(both()) == ["tiny", "base", "tiny"]
    assert routes.current.name == "base"  # outside any request: the first model
