"""The JSON Schema keywords that xgrammar (0.2) would silently not enforce: a schema using one is refused, so
that output "validated" against a schema always satisfies it (vLLM refuses such schemas too).

Measured against xgrammar's compiled grammars and jsonschema (tests/sample/test_unenforced_schemas.py): ignored
outright are `not`, `if`/`then`/`else`, `dependentSchemas` (and draft 7's schema-valued `dependencies`),
`uniqueItems: true` and `$dynamicRef`; a `$ref` that is not `#` or `#/...`; `allOf` of more than one schema;
keywords beside a `$ref`, `allOf`, `anyOf` or `oneOf` (only the reference or the branches count); `oneOf`
branches that may overlap (read as `anyOf`); `multipleOf` but on integers with no range or a closed one;
`minLength`/`maxLength` beside a `format` or `pattern`, and a `pattern` beside a `format`.
"""

from __future__ import annotations

import json
import math
from typing import Any
from urllib.parse import unquote

from rayllm.protocol.schema_bounds import schema_nodes

# Keywords that do not constrain a value (annotations; unknown keywords, such as `x-...` or OpenAPI's
# `nullable` and `discriminator`, are ignored by JSON Schema too).
_ASSERTIONS = frozenset((
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
    "contains", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentSchemas", "dependencies", "$ref", "$dynamicRef", "$recursiveRef"))
_IGNORED = ("not", "if", "then", "else", "dependentSchemas", "$dynamicRef", "$recursiveRef")
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_TYPES = frozenset(("string", "number", "integer", "boolean", "object", "array", "null"))
_MAX_PAIRWISE = 64  # oneOf branches compared pair by pair, at most


class UnsupportedSchema(ValueError):
    """A schema keyword the grammar engine would not enforce; the message names where it is."""


def check_schema_support(schema: object) -> None:
    """Raise UnsupportedSchema at the first keyword of the schema (valid JSON Schema, bounded) that xgrammar would
    not enforce. Subschemas that a `$ref` reaches outside the usual places (`$defs`, `properties`...) count too."""
    seen: set[int] = set()
    pending: list[tuple[str, object]] = [("", schema)]
    while pending:
        start, root = pending.pop()
        if id(root) in seen:
            continue
        for path, node, is_schema in schema_nodes(root, start):
            if not is_schema or not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            where = path.lstrip("/") or "the top level"
            problem = _problem(schema, node)
            if problem:
                raise UnsupportedSchema(f"at {where}: {problem}")
            ref = node.get("$ref")
            if isinstance(ref, str) and ref != "#":
                pending.append((ref[1:], resolve(schema, ref)))  # checked already if a subschema sits there


def resolve(schema: object, ref: str) -> object:
    """The subschema a local `$ref` (`#/a/b`) points to, or None."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _problem(root: object, node: dict[str, Any]) -> str | None:
    for key in _IGNORED:
        if key in node:
            return f"`{key}` is not supported"
    if isinstance(node.get("dependencies"), dict) and any(
            isinstance(v, dict | bool) for v in node["dependencies"].values()):
        return "`dependencies` with a schema is not supported (a list of names is)"
    if node.get("uniqueItems") is True:
        return "`uniqueItems: true` is not supported"
    ref = node.get("$ref")
    if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
        return f"`$ref` {json.dumps(ref)} is not supported: only references inside the schema (`#/...`) are"
    combinators = [k for k in _COMBINATORS if k in node]
    if len(combinators) > 1:
        return f"{' and '.join(f'`{k}`' for k in combinators)} together are not supported: use one"
    if combinators:
        problem = _combined(root, node, combinators[0])
        if problem:
            return problem
    return _multiple_of(node) or _string(node)


def _combined(root: object, node: dict[str, Any], key: str) -> str | None:
    """`$ref`, `allOf`, `anyOf` or `oneOf`: only its schemas count, so no other keyword may constrain beside it
    (a `type` that each branch already has is no constraint)."""
    branches = [resolve(root, node[key])] if key == "$ref" else node[key]
    if key == "allOf" and len(branches) > 1:
        return "`allOf` of more than one schema is not supported: merge them into one"
    extra = sorted(k for k in node if k in _ASSERTIONS and k != key)
    if extra == ["type"] and all(_types(root, b) <= _types(root, node) for b in branches):
        extra = []
    if extra:
        return (f"{', '.join(f'`{k}`' for k in extra)} beside `{key}` is not supported: only the `{key}` counts; "
                "move it into the referenced schema or each branch")
    if key == "oneOf" and not _disjoint(root, branches):
        return "`oneOf` whose branches may overlap is not supported (it would act as `anyOf`): use `anyOf`"
    return None


def _types(root: object, node: object) -> frozenset[str]:
    """The JSON types a (sub)schema allows, by its `type`, `const` or `enum` (`number` includes `integer`); all
    of them when it says none."""
    for _ in range(8):  # through a few `$ref`s
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and "type" not in node:
            node = resolve(root, node["$ref"])
    if not isinstance(node, dict):
        return _TYPES
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kinds is not None:
        return frozenset(kinds) | ({"integer"} if "number" in kinds else set())
    values = [node["const"]] if "const" in node else node.get("enum")
    if isinstance(values, list):
        return frozenset(_json_type(v) for v in values)
    return _TYPES


def _json_type(value: object) -> str:
    """A value's JSON type, `integer` for a whole number (JSON Schema's reading)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def _disjoint(root: object, branches: list[Any]) -> bool:
    """Whether no value can match two of the branches, by what the grammar engine also tells apart: their
    types, their `const`/`enum` values, or a required property whose `const`/`enum` values differ (a
    discriminated union, as pydantic writes one). Linear in the branches when values or one property tell
    them all apart; pair by pair only for a few branches (a 64 KiB schema may hold thousands)."""
    resolved = [resolve(root, b["$ref"]) if isinstance(b, dict) and isinstance(b.get("$ref"), str) else b
                for b in branches]
    values = [_values(b) for b in resolved]
    if all(v is not None for v in values) and _no_value_twice(values):
        return True
    tags = [_tags(b) for b in resolved]
    shared = set.intersection(*(set(t) for t in tags)) if tags else set()
    if any(_no_value_twice([t[name] for t in tags]) for name in shared):
        return True
    if len(resolved) > _MAX_PAIRWISE:
        return False
    types = [_types(root, b) for b in resolved]
    for i in range(len(resolved)):
        for j in range(i + 1, len(resolved)):
            va, vb = values[i], values[j]
            apart = (not types[i] & types[j] or va is not None and vb is not None and not va & vb
                     or any(not tags[i][name] & tags[j][name] for name in tags[i].keys() & tags[j].keys()))
            if not apart:
                return False
    return True


def _no_value_twice(sets: list[Any]) -> bool:
    return sum(len(s) for s in sets) == len(set().union(*sets))


def _values(node: object) -> set[str] | None:
    """A schema's `const` / `enum` values (as canonical JSON), or None when it has neither."""
    if not isinstance(node, dict):
        return None
    values = [node["const"]] if "const" in node else node.get("enum")
    return {json.dumps(v, sort_keys=True) for v in values} if isinstance(values, list) else None


def _tags(node: object) -> dict[str, set[str]]:
    """An object schema's required properties that have `const` / `enum` values: name -> values."""
    if not isinstance(node, dict) or not isinstance(node.get("properties"), dict):
        return {}
    props, required = node["properties"], node.get("required") or ()
    found = {name: _values(props[name]) for name in required if isinstance(name, str) and name in props}
    return {name: v for name, v in found.items() if v is not None}


def _multiple_of(node: dict[str, Any]) -> str | None:
    step = node.get("multipleOf")
    if step is None:
        return None
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "integer" not in kinds or "number" in kinds:
        return "`multipleOf` is supported on integers only (`type: integer`)"
    if not (isinstance(step, int) or isinstance(step, float) and math.isfinite(step) and step.is_integer()):
        return "`multipleOf` must be a whole number"
    low = "minimum" in node or "exclusiveMinimum" in node
    high = "maximum" in node or "exclusiveMaximum" in node
    if low != high:
        return "`multipleOf` with only a lower or only an upper bound is not supported: give both or neither"
    return None


def _string(node: dict[str, Any]) -> str | None:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    for shape in ("format", "pattern"):
        if shape in node and lengths:
            return f"`{lengths[0]}` beside `{shape}` is not supported: put the length in a `pattern`"
    if "format" in node and "pattern" in node:
        return "`pattern` beside `format` is not supported: use one"
    return None
