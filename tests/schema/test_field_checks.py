"""The generic field-type check against values as PyYAML reads them (YAML 1.1: `no` is false, `.nan` a float,
`1e3` a string)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import pytest
import yaml

from rayllm.schema.field_checks import SECRET, Bounds, check_fields, check_instance


@dataclass(frozen=True)
class Inner:
    enabled: bool = True


@dataclass(frozen=True)
class Example:
    keys: Annotated[tuple[str, ...], SECRET] = ()
    ratio: Annotated[float, Bounds(gt=0, le=1)] = 1.0
    level: Annotated[int, Bounds(ge=0, le=19)] | Literal["auto"] = "auto"
    pairs: tuple[tuple[str, str], ...] = ()
    inner: Inner = Inner()

    def __post_init__(self) -> None:
        check_instance(self)


@pytest.mark.parametrize("text, message", [
    ("keys: hunter2", r"^keys must be a list of strings, got a str \(not shown\)$"),
    ("ratio: .nan", r"^ratio must be a finite number > 0 and <= 1, got nan$"),
    ("ratio: 1e3", r"^ratio must be a finite number > 0 and <= 1, got '1e3'$"),  # YAML 1.1: no dot, a string
    ("ratio: 0", r"^ratio must be a finite number > 0 and <= 1, got 0$"),
    ("ratio: " + "9" * 400, r"^ratio must be a finite number > 0 and <= 1, got 9{400}$"),  # beyond a float's range
    ("level: yes", r"^level must be an integer >= 0 and <= 19 or auto, got True$"),  # True == 1, yet no integer
    ("pairs: [[a, b]]", r"^pairs must be a mapping of strings to strings, got \[\['a', 'b'\]\]$"),
    ("inner: {enabled: 'no'}", r"^inner\.enabled must be true or false, got 'no'$"),
    ("inner: [x]", r"^inner must be a mapping, got \['x'\]$"),
])
def test_yaml_values_of_the_wrong_kind_are_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        check_fields(Example, yaml.safe_load(text))


def test_yaml_values_of_the_right_kind_pass():
    check_fields(Example, yaml.safe_load("{keys: [a], ratio: 1, level: 19, pairs: {a: b}, inner: {enabled: no}, other: 1}"))


def test_an_instance_is_checked_and_its_lists_become_tuples():
    assert Example(keys=["a", "b"]).keys == ("a", "b")
    with pytest.raises(ValueError, match=r"^inner must be a mapping, got \{'enabled': False\}$"):  # built ones only
        Example(inner={"enabled": False})
    with pytest.raises(ValueError, match="^level must be"):
        Example(level="high")
