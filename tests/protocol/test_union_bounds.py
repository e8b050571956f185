"""Length bounds on fields that take one value or a list of them (`text_1`, `lora_path`, `rid`): the list's
bound (items) belongs to the list alone. On the union pydantic applied it to the string too, so /v1/score
refused a text over 1,024 characters and the JSON schema advertised `maxLength` 1024 for it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import rayllm.protocol
from rayllm.protocol import limits as L
from rayllm.protocol.embeddings import MAX_INPUTS
from rayllm.protocol.errors import from_validation_error
from rayllm.protocol.request_models import ChatCompletionRequest, CompletionRequest
from rayllm.protocol.scores import ScoreRequest, score_pairs

BOUNDS = ("maxLength", "minLength", "maxItems", "minItems")


def protocol_models() -> list[type[BaseModel]]:
    """Every request and response model defined in rayllm.protocol."""
    found: dict[str, type[BaseModel]] = {}
    for info in pkgutil.walk_packages(rayllm.protocol.__path__, "rayllm.protocol."):
        module = importlib.import_module(info.name)
        for cls in vars(module).values():
            if inspect.isclass(cls) and issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return list(found.values())


def bounds_on_unions(node: Any, path: str = "") -> list[str]:
    """The JSON-schema paths where a length bound sits beside `anyOf` (so on every branch of it)."""
    out: list[str] = []
    if isinstance(node, dict):
        if "anyOf" in node and any(k in node for k in BOUNDS):
            out.append(f"{path}: {[k for k in BOUNDS if k in node]} beside anyOf")
        for key, value in node.items():
            out += bounds_on_unions(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += bounds_on_unions(value, f"{path}/{i}")
    return out


@pytest.mark.parametrize("model", protocol_models(), ids=lambda m: m.__name__)
def test_no_length_bound_applies_to_a_whole_union(model):
    assert bounds_on_unions(model.model_json_schema()) == []


def test_a_long_score_text_parses_and_the_list_stays_bounded():
    long_text = "word " * 1000  # 5,000 characters: one text, not 5,000 items
    req = ScoreRequest.model_validate({"text_1": long_text, "text_2": [long_text, "b"]})
    assert score_pairs(req) == ([long_text, long_text], [long_text, "b"])
    with pytest.raises(ValidationError) as exc:
        ScoreRequest.model_validate({"text_1": ["a"] * (MAX_INPUTS // 2 + 1), "text_2": "b"})
    err = from_validation_error(exc.value)
    assert (err.param, err.status_code) == ("text_1", 400) and "at most 1024 items" in err.message
    schema = ScoreRequest.model_json_schema()["properties"]["text_2"]["anyOf"]
    assert {b["type"]: b.get("maxLength", b.get("maxItems")) for b in schema} == {"string": None, "array": 1024}


@pytest.mark.parametrize("cls, base", [(CompletionRequest, {"prompt": "x"}),
                                       (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_lora_path_is_bounded_as_a_path_and_its_list_by_the_prompt_count(cls, base):
    path = "/adapters/" + "d" * 2000  # past the list's item bound, within PATH_MAX
    assert cls.model_validate(base | {"lora_path": path}).lora_path == path
    assert cls.model_validate(base | {"lora_path": [path, None]}).lora_path == [path, None]
    for value, param, words in (("/" + "d" * L.MAX_PATH_CHARS, "lora_path", "4096 characters"),
                                (["/a"] * (L.MAX_PROMPTS + 1), "lora_path", f"{L.MAX_PROMPTS} items"),
                                ([None, "/" + "d" * L.MAX_PATH_CHARS], "lora_path.1", "4096 characters")):
        with pytest.raises(ValidationError) as exc:
            cls.model_validate(base | {"lora_path": value})
        err = from_validation_error(exc.value)
        assert err.param == param and words in err.message, err.message
    with pytest.raises(ValidationError):  # SGLang's rid: an id (256 characters) or one per prompt
        cls.model_validate(base | {"rid": ["r"] * (L.MAX_PROMPTS + 1)})
    assert cls.model_validate(base | {"rid": "r" * L.MAX_ID_CHARS}).rid == "r" * L.MAX_ID_CHARS
