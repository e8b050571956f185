"""Config values checked against their dataclass field types when the config is read, so that a YAML value
of the wrong kind fails the deploy naming the field, instead of meaning something else: a bare string where a
list of keys belongs (a tuple of its characters), the string "false" where a boolean belongs (truthy), .nan
or a negative number where a duration belongs. A field's range is part of its type: `Annotated[float,
Bounds(gt=0)]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints


@dataclass(frozen=True)
class Bounds:
    """A number's range, in its field's type (`None`: no bound on that side)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def holds(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def __str__(self) -> str:
        parts = [(">=", self.ge), (">", self.gt), ("<=", self.le)]
        return " and ".join(f"{op} {bound:g}" for op, bound in parts if bound is not None)


# In a field's Annotated type: its value is never repeated in an error (it holds API keys).
SECRET = "secret"


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """A dataclass's fields and their resolved types (Annotated ranges kept)."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_fields(cls: type, values: Mapping[str, Any], section: str = "") -> None:
    """Each entry of `values`, a mapping read from YAML, that names a field of the dataclass `cls` against that
    field's type: YAML lists stand for tuples, mappings for nested dataclasses (checked in turn) and for tuples
    of pairs. Names that are not fields are left to the constructor (its TypeError names them)."""
    hints = field_types(cls)
    for name, value in values.items():
        if name in hints:
            _check(section + name, value, hints[name], raw=True)


def check_instance(obj: Any, section: str = "") -> None:
    """A frozen dataclass's own fields against their types (nested dataclasses must be built already); a list
    given for a tuple field is stored as a tuple. For __post_init__."""
    for name, hint in field_types(type(obj)).items():
        value = getattr(obj, name)
        _check(section + name, value, hint, raw=False)
        if isinstance(value, list):  # only a tuple field accepts a list
            object.__setattr__(obj, name, tuple(value))


def _check(name: str, value: Any, hint: Any, raw: bool) -> None:
    if not _fits(name, value, hint, raw):
        shown = f"a {type(value).__name__} (not shown)" if _is_secret(hint) else repr(value)
        raise ValueError(f"{name} must be {_describe(hint)}, got {shown}")


def _is_secret(hint: Any) -> bool:
    return get_origin(hint) is Annotated and SECRET in hint.__metadata__


def _members(hint: Any) -> tuple[Any, ...] | None:
    """The alternatives of a union type, else None."""
    return get_args(hint) if get_origin(hint) in (Union, types.UnionType) else None


def _fits(name: str, value: Any, hint: Any, raw: bool) -> bool:
    if hint is Any:
        return True
    if get_origin(hint) is Annotated:
        bounds = [m for m in hint.__metadata__ if isinstance(m, Bounds)]
        return _fits(name, value, hint.__origin__, raw) and all(b.holds(value) for b in bounds)
    members = _members(hint)
    if members is not None:
        return any(_fits(name, value, member, raw) for member in members)
    if hint is type(None):
        return value is None
    if get_origin(hint) is Literal:  # by type too: True == 1
        return any(value == choice and type(value) is type(choice) for choice in get_args(hint))
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        if isinstance(value, int):  # an integer is finite (and may be too large for a float)
            return not isinstance(value, bool)
        return isinstance(value, float) and math.isfinite(value)
    if get_origin(hint) is tuple:
        return _fits_tuple(name, value, get_args(hint), raw)
    if get_origin(hint) in (dict, Mapping):
        key, item = get_args(hint)
        return isinstance(value, Mapping) and all(_fits(name, k, key, raw) and _fits(name, v, item, raw)
                                                  for k, v in value.items())
    if dataclasses.is_dataclass(hint) and raw and isinstance(value, Mapping):
        check_fields(hint, value, name + ".")  # raises naming the nested field
        return True
    return isinstance(value, hint)


def _fits_tuple(name: str, value: Any, args: tuple[Any, ...], raw: bool) -> bool:
    if len(args) == 2 and args[1] is Ellipsis:
        if _is_pairs(args) and raw:  # name -> value pairs are written as a YAML mapping
            if not isinstance(value, Mapping):
                return False
            value = list(value.items())
        return isinstance(value, tuple | list) and all(_fits(name, v, args[0], raw) for v in value)
    return isinstance(value, tuple | list) and len(value) == len(args) and all(
        _fits(name, v, a, raw) for v, a in zip(value, args, strict=True))


def _is_pairs(args: tuple[Any, ...]) -> bool:
    """`tuple[tuple[K, V], ...]`'s arguments: a mapping's items."""
    return get_origin(args[0]) is tuple and len(get_args(args[0])) == 2 and Ellipsis not in get_args(args[0])


def _describe(hint: Any) -> str:
    """The type in words, as a config's author writes it (YAML's names)."""
    if get_origin(hint) is Annotated:
        bounds = " ".join(str(m) for m in hint.__metadata__ if isinstance(m, Bounds))
        return f"{_describe(hint.__origin__)} {bounds}".rstrip()
    members = _members(hint)
    if members is not None:
        return " or ".join(_describe(member) for member in members)
    if get_origin(hint) is Literal:
        choices = [str(choice) for choice in get_args(hint)]
        return choices[0] if len(choices) == 1 else "one of " + ", ".join(choices)
    if get_origin(hint) is tuple:
        args = get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and _is_pairs(args):
            return "a mapping of {} to {}".format(*map(_plural, get_args(args[0])))
        if len(args) == 2 and args[1] is Ellipsis:
            return "a list of " + _plural(args[0])
        return f"a list of {len(args)} items"
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a finite number",
             str: "a string"}
    if hint in names:
        return names[hint]
    return "a mapping" if get_origin(hint) in (dict, Mapping) or dataclasses.is_dataclass(hint) else \
        f"a {getattr(hint, '__name__', hint)}"


def _plural(hint: Any) -> str:
    return "strings" if hint is str else f"{_describe(hint)} items"
