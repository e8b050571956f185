"""rayllm.protocol.grammar_bounds through guided_spec (and the tool and Responses paths): a regex, grammar,
schema or structural tag that nests repetitions in counted ones, repeats past MAX_REPEAT_COUNT, nests groups too
deep or has too many rules is a 400 naming the field before it reaches the compiler; realistic ones pass (that
xgrammar compiles and matches them: tests/sample/test_realistic_constraints.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayllm.protocol import limits as L
from rayllm.protocol import responses_api as R
from rayllm.protocol.errors import APIError
from rayllm.protocol.grammar_bounds import GrammarTooComplex, check_ebnf, check_regex
from rayllm.protocol.protocol import ChatCompletionRequest, CompletionRequest
from rayllm.protocol.structured import guided_spec
from rayllm.protocol.tools import plan_tools

MSG = [{"role": "user", "content": "hi"}]

# Realistic constraints: OpenAI's structured-output examples, a tool's parameters, common regexes and grammars.
MATH = {"type": "object", "properties": {
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "explanation": {"type": "string"}, "output": {"type": "string"}},
        "required": ["explanation", "output"], "additionalProperties": False}},
    "final_answer": {"type": "string"}}, "required": ["steps", "final_answer"], "additionalProperties": False}
UI = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
    "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}},
    "attributes": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "value": {"type": "string"}}, "required": ["name", "value"],
        "additionalProperties": False}}},
    "required": ["type", "label", "children", "attributes"], "additionalProperties": False}
PROFILE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 100},
    "username": {"type": "string", "pattern": "^@[a-zA-Z0-9_]+$"},
    "phone": {"type": "string", "pattern": r"^\(\d{3}\) \d{3}-\d{4}$"},
    "ip": {"type": "string", "pattern": r"^((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)$"},
    "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 100},
               "minItems": 1, "maxItems": 10},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 1000}, "maxItems": 1000},
    "address": {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string"}, "zip": {"type": "string", "pattern": r"^\d{5}(-\d{4})?$"}}}}}},
    "required": ["name", "username"]}
WEATHER_TOOL = {"type": "object", "properties": {
    "location": {"type": "string", "description": "City and country e.g. Bogotá, Colombia"},
    "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "units"], "additionalProperties": False}
REGEXES = [r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,6}", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?",
           r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", r"(\d{3}-){1,1000}\d{4}",
           r"\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?", r"[a-z]+(,[a-z]+){0,1000}", r"(a|b){1,1000000}", r"(\d{1,3}\.){3}\d{1,3}",
           r"[A-Z][a-z]{1,20}( [A-Z][a-z]{1,20}){0,3}", r"(?:[a-z]+)( (?:[a-z]+))*", r"\d{1,300}(\.\d{1,300}){3}",
           r"[a-z]{0,1000}[0-9]{0,1000}", "[a-z]{0,16}" * 20, "(" * L.MAX_REGEX_NESTING + "a" + ")" * L.MAX_REGEX_NESTING]
JSON_GRAMMAR = r'''root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" (string ":" value ("," string ":" value)*)? "}"  # members
array ::= "[" (value ("," value)*)? "]"
string ::= "\"" [^"\\]* "\""
number ::= "-"? [0-9]+ ("." [0-9]+)?'''
GRAMMARS = [JSON_GRAMMAR, 'root ::= item (", " item){0,4}\nitem ::= [a-z]+', 'root ::= ("- " [a-z ]+ "\\n"){1,10}',
            'root ::= "yes" | "no"', 'root ::= [0-9]{3} "-" [0-9]{4}', 'root ::= a "," a "," a\na ::= [a-z]{0,1000}']

# Each too complex in one way; measured with xgrammar 0.2.8 (docs/security.md): the nested ones fill a token's
# mask in hundreds of milliseconds to seconds within 20-50 tokens.
NESTED_REGEXES = [r"([a-z]{1,1000}){1,1000}", r"([a-z]{1,50}){1,50}", r"([a-z]+){1,16}", r"([a-z]{1,1000})+",
                  r"([a-z]*){100}", r"(\w+\s){1,20}", r"((a{1,4}){1,4}){1,4}", r"(,[a-z,]+){0,100}", r"(a|,b+){1,100}"]
NESTED_GRAMMARS = ['root ::= item{1,1000}\nitem ::= [a-z]+', 'root ::= r{1,100}\nr ::= "a" r | "a"',
                   'root ::= r\nr ::= [a-z]{1,100} r | ""', 'root ::= a b\na ::= b{1,100}\nb ::= c\nc ::= [a-z]*',
                   'root ::= ("," item){0,4}\nitem ::= [^a]+']
# Long counts of variable count in a row, no delimiter between them: three `[a-z]{0,1000}` take 170 ms a token by
# the 120th (two: 7 ms).
ADJACENT = [({"regex": "[a-z]{0,1000}" * 3}, "regex", "has 3 counted repetitions"),
            ({"guided_regex": "x[a-z]{0,1000}[a-z]{0,1000}y[a-z]{0,1000}"}, "guided_regex", "has 3"),  # y: no end
            ({"guided_regex": "([a-z]{0,100})" * 3}, "guided_regex", "has 3"),
            ({"ebnf": "root ::= a a a\na ::= [a-z]{0,1000}"}, "ebnf", "has 3"),
            ({"ebnf": "root ::= b b\nb ::= [a-z]{0,1000} [a-z]{0,1000}"}, "ebnf", "has 4")]
MANY_RULES = "root ::= r0\n" + "\n".join(f'r{i} ::= "a"' for i in range(L.MAX_GRAMMAR_RULES))
DEEP_GRAMMAR = "root ::= " + "(" * (L.MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (L.MAX_GRAMMAR_NESTING + 1)
HUGE = L.MAX_REPEAT_COUNT + 1


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG} | kw)


def refused(make: Any, param: str, match: str) -> None:
    with pytest.raises(APIError) as e:
        make()
    assert (e.value.status_code, e.value.param, e.value.code) == (400, param, "constraint_too_complex"), e.value
    assert e.value.message.startswith(param) and match in e.value.message, e.value.message


@pytest.mark.parametrize("pattern", NESTED_REGEXES)
def test_nested_repetitions_in_a_regex_are_400s(pattern):
    for body, param in (({"guided_regex": pattern}, "guided_regex"), ({"regex": pattern}, "regex"),
                        ({"structured_outputs": {"regex": pattern}}, "structured_outputs.regex"),
                        ({"response_format": {"type": "regex", "regex": pattern}}, "response_format")):
        refused(lambda b=body: guided_spec(chat(**b)), param, "nests a repetition in a counted one")


@pytest.mark.parametrize("grammar", NESTED_GRAMMARS)
def test_nested_repetitions_in_a_grammar_are_400s_across_rules(grammar):
    for body, param in (({"ebnf": grammar}, "ebnf"), ({"guided_grammar": grammar}, "guided_grammar"),
                        ({"structured_outputs": {"grammar": grammar}}, "structured_outputs.grammar"),
                        ({"response_format": {"type": "grammar", "grammar": grammar}}, "response_format")):
        refused(lambda b=body: guided_spec(chat(**b)), param, "nests a repetition in a counted one")


@pytest.mark.parametrize("body, param, match", [
    ({"guided_regex": f"a{{{HUGE}}}"}, "guided_regex", f"repeats something {HUGE} times"),
    ({"regex": "[a-z]{1," + "9" * 60000 + "}"}, "regex", "more than 1048576 times (`{1,999"),
    ({"ebnf": f'root ::= "a"{{0,{HUGE}}}'}, "ebnf", f"repeats something {HUGE} times"),
    ({"guided_grammar": DEEP_GRAMMAR}, "guided_grammar", "nests groups more than 64 deep"),
    ({"structured_outputs": {"grammar": MANY_RULES}}, "structured_outputs.grammar", "has 1025 rules, at most 1024"),
    ({"guided_json": {"type": "array", "minItems": 10**9}}, "guided_json", "has minItems 1000000000"),
    ({"guided_json": json.dumps({"type": "object", "properties": {"a": {"type": "string", "maxLength": HUGE}}})},
     "guided_json", "(at properties/a)"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "([a-z]{1,50}){1,50}"}}}}}},
     "response_format.json_schema.schema", "(at properties/code/pattern)"),
    ({"structured_outputs": {"json": {"type": "object", "patternProperties": {"^(a+){2,100}$": {}}}}},
     "structured_outputs.json", "(at patternProperties)"),
    ({"response_format": {"type": "structural_tag", "format": {
        "type": "repeat", "min": 1, "max": 1000, "content": {"type": "regex", "pattern": "[a-z]+"}}}},
     "response_format", "`repeat` at format"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "x"}, {"type": "regex", "pattern": "([a-z]*){100}"}]}}},
     "response_format", "(at format/elements/1/pattern)"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": {"type": "star", "content": {
        "type": "grammar", "grammar": 'root ::= [a-z]{1,30}'}}})}}, "structured_outputs.structural_tag", "`star`"),
    ({"structured_outputs": {"structural_tag": json.dumps({"format": {"type": "json_schema", "json_schema": {
        "type": "string", "pattern": "(a*){100}"}}})}}, "structured_outputs.structural_tag",
     "(at format/json_schema/pattern)"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>", "schema": {
        "type": "array", "maxItems": HUGE}}], "triggers": ["<a>"]}}, "response_format.structures.schema", "maxItems"),
])
def test_every_constraint_field_is_bounded(body, param, match):
    refused(lambda: guided_spec(chat(**body)), param, match)


@pytest.mark.parametrize("body, param, match", ADJACENT)
def test_long_counts_in_a_row_are_400s(body, param, match):
    refused(lambda: guided_spec(chat(**body)), param, match)


def test_completions_json_schema_and_the_tool_and_responses_schemas_are_bounded():
    deep_pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(\\w+\\s){1,20}"}}}
    refused(lambda: guided_spec(CompletionRequest(model="m", prompt="x", json_schema=json.dumps(deep_pattern))),
            "json_schema", "nests a repetition")
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep_pattern}}]
    refused(lambda: plan_tools(chat(tools=tools), other_constraint=False), "tools.0.function.parameters",
            "(at properties/a/pattern)")
    text = R.TextConfig.model_validate({"format": {"type": "json_schema", "name": "x", "schema": deep_pattern}})
    refused(lambda: R.chat_response_format(text), "text.format.schema", "nests a repetition")


@pytest.mark.parametrize("schema", [MATH, UI, PROFILE, WEATHER_TOOL])
def test_realistic_schemas_pass(schema):
    for body in ({"guided_json": schema}, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema, "strict": True}}}):
        spec = guided_spec(chat(**body))
        assert spec is not None and json.loads(spec.value) == schema
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert plan_tools(chat(tools=tools, tool_choice="required"), other_constraint=False) is not None


@pytest.mark.parametrize("pattern", REGEXES)
def test_realistic_regexes_pass(pattern):
    spec = guided_spec(chat(guided_regex=pattern))
    assert spec is not None and spec.value == pattern


@pytest.mark.parametrize("grammar", GRAMMARS)
def test_realistic_grammars_pass(grammar):
    spec = guided_spec(chat(ebnf=grammar))
    assert spec is not None and spec.value == grammar


def test_the_bounds_hold_at_their_limits():
    check_regex(f"a{{{L.MAX_REPEAT_COUNT}}}")
    check_regex("((a{1,4}){1,4})?")  # 16: the bound
    check_ebnf("root ::= " + "(" * L.MAX_GRAMMAR_NESTING + '"a"' + ")" * L.MAX_GRAMMAR_NESTING)
    check_ebnf("\n".join(f'r{i} ::= "a"' for i in range(L.MAX_GRAMMAR_RULES)))
    with pytest.raises(GrammarTooComplex, match="multiply to 20"):
        check_regex("((a{1,4}){1,5})?")
    with pytest.raises(GrammarTooComplex, match="more than 64 deep"):
        check_regex("(" * 65 + ")" * 65)


def test_strings_classes_escapes_and_comments_are_not_repetitions():
    """`{1,100}` in a string, a class, after an escaped brace or in a comment repeats nothing (read as a count,
    each of these would nest a repetition in `{1,100}`)."""
    check_ebnf('root ::= ([a-z] "{1,100}"){1,100}  # ([a-z]+){1,100}')
    check_regex(r"([a-z][{]1,100}){1,100}")
    check_regex(r"([a-z]\{1,100}){1,100}")
    check_regex(r"(?:[a-z]\p{L}){1,100}")
    check_ebnf('root ::= ("," [a-z]+){1,100}')  # each repetition starts with `,`: delimited
    with pytest.raises(GrammarTooComplex):
        check_regex(r"(\\[a-z]+\\){1,100}")  # `\\` at both ends is no delimiter: it occurs twice
