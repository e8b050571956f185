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


def test_adapter_admin_bodies_name_a_base_model(routes):
    """The load / unload bodies' `model`: a name or alias (default the first model); unload without it
    finds the model holding the adapter."""
    names = [routes.base(m).name for m in (None, "base", "b", "tiny", "small")]
    assert names == ["base", "base", "base", "tiny", "tiny"]
    for model in ("nope", "tiny:poem", "poem"):  # not a base model's name or alias
        with pytest.raises(APIError) as err:
            routes.base(model)
        assert err.value.status_code == 404 and err.value.code == "model_not_found" and err.value.param == "model"
        assert f"`{model}`" in err.value.message
    assert routes.holding("poem").name == "tiny" and routes.holding("sql").name == "base"
    assert routes.holding("never-loaded").name == "base"  # whose table then answers the 404


def test_adapter_names_that_clash_with_models_or_other_adapters_are_refused(routes):
    """An adapter is addressed by its bare name: a model's name or alias, or another model's adapter, would
    make it unreachable (and listed twice), so the load route refuses them, and start-up refuses such
    cluster.yaml adapters."""
    tiny = routes.base("tiny")
    for name, words in (("b", "alias of model 'base'"), ("base", "name of model 'base'"),
                        ("t", "alias of model 'tiny'"), ("sql", "model 'base' has an adapter")):
        with pytest.raises(APIError) as err:
            routes.check_new_adapter(tiny, name)
        assert err.value.status_code == 400 and err.value.param == "lora_name" and words in err.value.message
    assert routes.check_new_adapter(tiny, "fresh") == "fresh"

    def start(base_adapters: dict, tiny_adapters: dict) -> ModelRoutes:
        config = ServerConfig.from_args({"models": [
            {"served_model_name": "base", "engine": {"lora": {"max_loras": 1, "adapters": base_adapters}}},
            {"served_model_name": "tiny", "aliases": ["small"],
             "engine": {"lora": {"max_loras": 1, "adapters": tiny_adapters}}}]})
        return ModelRoutes(config.models, {"base": None, "tiny": None}, None, created=0)

    for base_adapters, tiny_adapters, words in (({"small": "/a/s"}, {}, "'small' cannot be used: it is an alias"),
                                                ({}, {"tiny": "/a/t"}, "'tiny' cannot be used: it is the name"),
                                                ({"sql": "/a/1"}, {"sql": "/a/2"}, "has an adapter of that name")):
        with pytest.raises(ValueError, match=words):
            start(base_adapters, tiny_adapters)
