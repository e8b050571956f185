"""Structured-output request fields -> one GuidedSpec (what the grammar engine constrains the output to).

Accepted spellings: OpenAI's `response_format` (json_object, json_schema; also vLLM's regex, grammar
and structural_tag types), SGLang's `regex`, `ebnf` and completions' `json_schema` string, and vLLM's
`guided_json`, `guided_regex`, `guided_grammar`, `guided_choice` and their newer `structured_outputs` object.
A request may use one of them.
Schemas are checked here (a 400 naming the problem), and every constraint against the bounds of limits.py
and grammar_bounds (size, nesting, repetition counts); regexes and grammars are then checked by the compiler
in the model replica, still before any token is generated.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

from rayllm.protocol import limits as L
from rayllm.protocol.errors import APIError, bad_request
from rayllm.protocol.grammar_bounds import GrammarTooComplex, check_ebnf, check_regex
from rayllm.protocol.request_models import SamplingFields, json_size
from rayllm.protocol.schema_bounds import check_schema_bounds, structural_rep
from rayllm.protocol.schema_support import UnsupportedSchema, check_schema_support
from rayllm.schema.sampling_params import GuidedSpec

# Any JSON object (OpenAI's json_object mode promises an object, not any JSON value).
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def check_json_schema(schema: Any, param: str, exact: bool = False) -> str:
    """The schema as compact JSON text, after checking it is a valid JSON Schema (small and shallow enough).
    `exact`: the output is promised to satisfy it (an output constraint), so a keyword that the grammar engine
    would not enforce is a 400 naming where it is (schema_support)."""
    if not isinstance(schema, str) and L.json_depth(schema) > L.MAX_JSON_DEPTH:  # before json_size recurses
        raise bad_request(f"{param} nests deeper than {L.MAX_JSON_DEPTH} levels", param=param)
    size = len(schema.encode()) if isinstance(schema, str) else json_size(schema)
    if size > L.MAX_SCHEMA_BYTES:
        raise bad_request(f"{param} is too large: {size} bytes as JSON, at most {L.MAX_SCHEMA_BYTES} are allowed",
                          param=param.split(".")[0], code="constraint_too_large")
    if isinstance(schema, str):
        schema = _loads(schema, param)
    if not isinstance(schema, dict | bool):
        raise bad_request(f"{param} must be a JSON Schema object", param=param)
    from jsonschema import SchemaError, validators

    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise bad_request(f"{param} is not a valid JSON Schema: {exc.message}" + (f" (at {where})" if where else ""),
                          param=param) from None
    except RecursionError:  # several frames per subschema level: a backstop for a call stack already deep
        raise bad_request(f"{param} nests too deeply to check", param=param) from None
    try:
        check_schema_bounds(schema)
    except GrammarTooComplex as exc:
        raise too_complex(param, exc) from None
    if exact:
        try:
            check_schema_support(schema)
        except UnsupportedSchema as exc:
            raise bad_request(f"{param} cannot be enforced {exc}", param=param, code="unsupported_schema") from None
    return json.dumps(schema, separators=(",", ":"))


def _loads(text: str, param: str) -> Any:
    """A client's JSON text, parsed; malformed or too deep is a 400 naming `param`."""
    try:
        return L.loads_bounded(text)
    except ValueError as exc:
        raise bad_request(f"{param} is not valid JSON: {exc}", param=param) from None


def choice_grammar(choices: list[str]) -> str:
    """EBNF matching exactly one of the strings (JSON string escapes are valid EBNF string escapes)."""
    if not choices:
        raise bad_request("guided_choice must list at least one choice", param="guided_choice")
    # Characters as themselves: xgrammar reads the \ud83d\ude00 that ASCII JSON writes for one emoji as two
    # characters (lone surrogates, which no UTF-8 output can spell).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def _legacy_structural_tag(fmt: dict[str, Any]) -> str:
    """vLLM's older structural_tag body ({structures: [{begin, schema, end}], triggers}) in xgrammar's form."""
    structures = fmt.get("structures")
    triggers = fmt.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list):
        raise bad_request("structural_tag needs `format`, or `structures` and `triggers`", param="response_format")
    tags = []
    for s in structures:
        if not isinstance(s, dict) or not {"begin", "end"} <= s.keys():
            raise bad_request("each structure needs begin, schema and end", param="response_format")
        schema = json.loads(check_json_schema(s.get("schema", {}), "response_format.structures.schema", exact=True))
        tags.append({"begin": s["begin"], "content": {"type": "json_schema", "json_schema": schema}, "end": s["end"]})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}})


def _from_structured_outputs(so: Any) -> list[GuidedSpec]:
    """vLLM's `structured_outputs` object: each constraint it sets (more than one is refused by the caller)."""
    specs = []
    if so.json_ is not None:
        param = "structured_outputs.json"
        specs.append(GuidedSpec("json_schema", check_json_schema(so.json_, param, exact=True), param))
    if so.regex is not None:
        specs.append(GuidedSpec("regex", so.regex, "structured_outputs.regex"))
    if so.choice is not None:
        if not so.choice:
            raise bad_request("structured_outputs.choice must list at least one choice", param="structured_outputs.choice")
        specs.append(GuidedSpec("ebnf", choice_grammar(so.choice), "structured_outputs.choice"))
    if so.grammar is not None:
        specs.append(GuidedSpec("ebnf", so.grammar, "structured_outputs.grammar"))
    if so.json_object:
        specs.append(GuidedSpec("json_schema", json.dumps(JSON_OBJECT_SCHEMA), "structured_outputs.json_object"))
    if so.structural_tag is not None:
        # Its size is checked with the others' only after parsing: here first, so no huge text is parsed.
        check_spec_size(GuidedSpec("structural_tag", so.structural_tag, "structured_outputs.structural_tag"))
        tag = _loads(so.structural_tag, "structured_outputs.structural_tag")
        if not isinstance(tag, dict):
            raise bad_request("structured_outputs.structural_tag must be a JSON object",
                              param="structured_outputs.structural_tag")
        body = ({"type": "structural_tag", "format": tag["format"]} if "format" in tag
                else json.loads(_legacy_structural_tag(tag)))
        specs.append(GuidedSpec("structural_tag", json.dumps(body), "structured_outputs.structural_tag"))
    if not specs:
        raise bad_request("structured_outputs sets no constraint (json, regex, choice, grammar, json_object or "
                          "structural_tag)", param="structured_outputs")
    return specs


def _from_response_format(rf: Any) -> GuidedSpec | None:
    extra = rf.model_extra or {}
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return GuidedSpec("json_schema", json.dumps(JSON_OBJECT_SCHEMA), "response_format")
    if rf.type == "json_schema":
        body = rf.json_schema
        if not isinstance(body, dict) or "schema" not in body and "json_schema" not in body:
            raise bad_request("response_format.json_schema needs a `schema`", param="response_format")
        schema = body.get("schema", body.get("json_schema"))
        return GuidedSpec("json_schema", check_json_schema(schema, "response_format.json_schema.schema", exact=True),
                          "response_format")
    if rf.type == "regex":
        pattern = extra.get("regex", extra.get("pattern"))
        if not isinstance(pattern, str):
            raise bad_request("response_format of type regex needs a `regex` string", param="response_format")
        return GuidedSpec("regex", pattern, "response_format")
    if rf.type == "grammar":
        grammar = extra.get("grammar", extra.get("ebnf"))
        if not isinstance(grammar, str):
            raise bad_request("response_format of type grammar needs a `grammar` string", param="response_format")
        return GuidedSpec("ebnf", grammar, "response_format")
    assert rf.type == "structural_tag"
    fmt = rf.model_dump(exclude_none=True)
    if L.json_depth(fmt) > L.MAX_JSON_DEPTH:  # json.dumps and the grammar compiler recurse per level
        raise bad_request(f"response_format nests deeper than {L.MAX_JSON_DEPTH} levels", param="response_format")
    if "format" in fmt:
        return GuidedSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt["format"]}),
                          "response_format")
    return GuidedSpec("structural_tag", _legacy_structural_tag(fmt), "response_format")


def guided_spec(req: SamplingFields) -> GuidedSpec | None:
    """The request's output constraint, or None. More than one constraint field is a 400."""
    specs: list[GuidedSpec] = []
    if req.response_format is not None:
        spec = _from_response_format(req.response_format)
        if spec is not None:
            specs.append(spec)
    if req.regex is not None:
        specs.append(GuidedSpec("regex", req.regex, "regex"))
    if req.guided_regex is not None:
        specs.append(GuidedSpec("regex", req.guided_regex, "guided_regex"))
    if req.ebnf is not None:
        specs.append(GuidedSpec("ebnf", req.ebnf, "ebnf"))
    if req.guided_grammar is not None:
        specs.append(GuidedSpec("ebnf", req.guided_grammar, "guided_grammar"))
    if req.guided_choice is not None:
        specs.append(GuidedSpec("ebnf", choice_grammar(req.guided_choice), "guided_choice"))
    if req.guided_json is not None:
        specs.append(GuidedSpec("json_schema", check_json_schema(req.guided_json, "guided_json", exact=True), "guided_json"))
    if req.structured_outputs is not None:
        specs.extend(_from_structured_outputs(req.structured_outputs))
    json_schema = getattr(req, "json_schema", None)
    if json_schema is not None:
        specs.append(GuidedSpec("json_schema", check_json_schema(json_schema, "json_schema", exact=True), "json_schema"))
    if len(specs) > 1:
        names = ", ".join(s.param for s in specs)
        raise bad_request(f"use one output constraint per request, got: {names}", param=specs[1].param)
    if specs:
        check_spec_size(specs[0])
        check_spec_shape(specs[0])
    return specs[0] if specs else None


def check_spec_size(spec: GuidedSpec) -> None:
    """Grammar compilation time grows with the spec: bound its size before it reaches the compiler."""
    limit = L.MAX_SCHEMA_BYTES if spec.kind in ("json_schema", "structural_tag") else L.MAX_GRAMMAR_CHARS
    size = len(spec.value.encode()) if spec.kind in ("json_schema", "structural_tag") else len(spec.value)
    if size > limit:
        unit = "bytes as JSON" if spec.kind in ("json_schema", "structural_tag") else "characters"
        raise bad_request(f"{spec.param} is too large: {size} {unit}, at most {limit} are allowed",
                          param=spec.param, code="constraint_too_large")


def check_spec_shape(spec: GuidedSpec) -> None:
    """Matching time grows with the repetitions nested in a constraint, parsing with its groups' nesting: bound
    them, and its repetition counts (grammar_bounds), before it reaches the compiler."""
    try:
        if spec.kind == "regex":
            check_regex(spec.value)
        elif spec.kind == "ebnf":
            check_ebnf(spec.value)
        elif spec.kind == "structural_tag":  # built here from the client's: valid JSON, MAX_JSON_DEPTH deep at most
            structural_rep(json.loads(spec.value).get("format"))
    except GrammarTooComplex as exc:
        raise too_complex(spec.param, exc) from None


def too_complex(param: str, exc: GrammarTooComplex) -> APIError:
    return bad_request(f"{param} {exc}", param=param, code="constraint_too_complex")


_REGEX_META = set(".^$*+?{}[]|()\\")


def _regex_literals(pattern: str) -> list[str] | None:
    """The alternatives of a regex that is a plain alternation of literals (`yes|no`, `(?:a|b\\.c)`), else None."""
    for head in ("(?:", "("):  # one group around it at most (a group inside one is not a literal)
        if pattern.startswith(head) and pattern.endswith(")"):
            inner = _alternation(pattern[len(head):-1])
            if inner is not None:
                return inner
    return _alternation(pattern)


def _alternation(pattern: str) -> list[str] | None:
    """The alternatives of `a|b\\.c`, when each is a literal; else None."""
    out, cur, i = [], [], 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= len(pattern) or pattern[i + 1] not in _REGEX_META | set("/-"):
                return None  # \d, \w, \n ...: a class or escape, not a literal
            cur.append(pattern[i + 1])
            i += 2
            continue
        if ch == "|":
            out.append("".join(cur))
            cur = []
        elif ch in _REGEX_META:
            return None
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def literal_choices(spec: GuidedSpec | None) -> list[str] | None:
    """The strings a constraint allows when it is a finite list of literals (guided_choice, or a regex that
    is a plain alternation), in request order without duplicates; None for any other constraint."""
    if spec is None:
        return None
    if spec.kind == "ebnf" and spec.param in ("guided_choice", "structured_outputs.choice"):
        body, decoder, choices = spec.value.removeprefix("root ::= "), json.JSONDecoder(), []
        while body:  # choice_grammar's own output: JSON strings joined by " | "
            choice, end = decoder.raw_decode(body)
            choices.append(choice)
            body = body[end:].removeprefix(" | ")
        return choices
    if spec.kind == "regex":
        found = _regex_literals(spec.value)
        found = list(dict.fromkeys(found)) if found is not None else None
        # Each literal is scored by an engine sequence of its own: past guided_choice's bound, the regex
        # constrains sampling as any other does (one sequence).
        return found if found is not None and len(found) <= L.MAX_GUIDED_CHOICES else None
    return None


def pick_choice(scores: list[float], temperature: float, seed: int | None) -> int:
    """Index of the chosen literal: the most likely at temperature 0, else a draw from softmax(score / T)."""
    if temperature == 0:
        return max(range(len(scores)), key=scores.__getitem__)
    top = max(scores)
    weights = [math.exp((s - top) / temperature) for s in scores]
    return random.Random(seed).choices(range(len(scores)), weights=weights)[0]
