"""Bounds on the regexes, grammars and counts inside a client's JSON schema or xgrammar structural tag
(rayllm.protocol.grammar_bounds reads each regex and grammar)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator

from rayllm.protocol import limits as L
from rayllm.protocol.grammar_bounds import (
    NONE,
    GrammarTooComplex,
    Rep,
    check_count,
    check_ebnf,
    check_regex,
    repeat,
)

# A schema's counts (xgrammar writes each as a `{m,n}`) and a structural tag's `repeat` bounds.
_COUNT_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties",
                   "minContains", "maxContains")


# Where a JSON schema (2020-12, draft 7) holds subschemas: a keyword's value, each item of a keyword's list
# (`items` was a list in draft 7), each value of a keyword's name map.
_SUBSCHEMA = frozenset(("items", "additionalItems", "additionalProperties", "not", "if", "then", "else", "contains",
                        "propertyNames", "unevaluatedItems", "unevaluatedProperties"))
_SUBSCHEMA_LIST = frozenset(("allOf", "anyOf", "oneOf", "prefixItems", "items"))
_SUBSCHEMA_MAP = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                            "dependencies"))


def schema_nodes(schema: object, path: str = "") -> Iterator[tuple[str, object, bool]]:
    """Every object and array in a JSON schema, level by level: its path, the node, and whether a subschema sits
    there (not a map of property names, an `enum` value or a `default`, which hold plain JSON)."""
    level: list[tuple[str, object, str | None]] = [(path, schema, "schema")]
    while level:
        nxt: list[tuple[str, object, str | None]] = []
        for path, node, role in level:
            yield path, node, role == "schema"
            if isinstance(node, dict):
                nxt.extend((f"{path}/{k}", v, _role(role, k, v)) for k, v in node.items())
            elif isinstance(node, list):
                nxt.extend((f"{path}/{i}", v, "schema" if role == "list" else None) for i, v in enumerate(node))
        level = nxt


def _role(parent: str | None, key: str, value: object) -> str | None:
    """What the value under `key` of a node of role `parent` is: a subschema, a list or map of them, or data."""
    if parent == "map":
        return "schema"
    if parent != "schema":
        return None
    if key in _SUBSCHEMA and isinstance(value, dict | bool):
        return "schema"
    if key in _SUBSCHEMA_LIST and isinstance(value, list):
        return "list"
    return "map" if key in _SUBSCHEMA_MAP and isinstance(value, dict) else None


def check_schema_bounds(schema: object, path: str = "") -> None:
    """A JSON schema's regexes (`pattern`, `patternProperties`) and counts; `path`: where it is in a structural tag.
    Its nesting is bounded already (MAX_JSON_DEPTH); the objects and arrays it describes are delimited, so nested
    counts there stay cheap (an array of 1000 strings of 1000 characters: under 1 ms a token). Every object is
    checked, subschema or not: a `$ref` may point anywhere in the document."""
    for at, node, _ in schema_nodes(schema, path):
        if not isinstance(node, dict):
            continue
        where = f" (at {at.lstrip('/')})" if at else ""
        if isinstance(node.get("pattern"), str):
            _at(check_regex, node["pattern"], f"{at}/pattern")
        if isinstance(node.get("patternProperties"), dict):
            for key in node["patternProperties"]:
                _at(check_regex, key, f"{at}/patternProperties")
        for key in _COUNT_KEYWORDS:
            if isinstance(node.get(key), int) and node[key] > L.MAX_REPEAT_COUNT:
                raise GrammarTooComplex(f"has {key} {node[key]}{where}, at most {L.MAX_REPEAT_COUNT} are allowed")


def _at(check: Callable[[str], Rep], text: str, path: str) -> Rep:
    try:
        return check(text)
    except GrammarTooComplex as exc:
        raise GrammarTooComplex(f"{exc} (at {path.lstrip('/')})") from None


def structural_rep(fmt: object, path: str = "format") -> Rep:
    """What an xgrammar structural-tag format repeats (its `repeat`, `star`, `plus` and `optional` around the
    regexes and grammars inside), with each regex, grammar and schema in it checked. Recursive: a tag nests at
    most MAX_JSON_DEPTH levels (checked before)."""
    if isinstance(fmt, list):
        return _join_all(structural_rep(f, f"{path}/{i}") for i, f in enumerate(fmt))
    if not isinstance(fmt, dict):
        return NONE
    kind = fmt.get("type")
    if kind == "regex" and isinstance(fmt.get("pattern"), str):
        return _at(check_regex, fmt["pattern"], f"{path}/pattern")
    if kind == "grammar" and isinstance(fmt.get("grammar"), str):
        return _at(check_ebnf, fmt["grammar"], f"{path}/grammar")
    if kind in ("json_schema", "qwen_xml_parameter"):
        check_schema_bounds(fmt.get("json_schema"), f"{path}/json_schema")
        return NONE
    if kind == "any_text":
        return Rep(math.inf, False, True)
    inner = _join_all(structural_rep(v, f"{path}/{k}") for k, v in fmt.items() if isinstance(v, dict | list))
    where = f"`{kind}` at {path}"
    if kind == "optional":
        return repeat(inner, 0, 1, False, where)
    if kind in ("star", "plus"):
        return repeat(inner, int(kind == "plus"), math.inf, False, where)
    if kind == "repeat" and isinstance(fmt.get("min"), int) and isinstance(fmt.get("max"), int):
        lo, hi = fmt["min"], fmt["max"]
        for count in (lo, hi):
            check_count(str(abs(count)), where)
        return repeat(inner, lo, math.inf if hi < 0 else hi, True, where)
    return inner


def _join_all(reps: Iterable[Rep]) -> Rep:
    return functools.reduce(Rep.join, reps, NONE)
