"""Per-request bounds fixed by the protocol or the engine (not by the operator: those are in ServerConfig).

Every number a client sends must fit what the engine holds (token ids and counts in int32 tensors,
seeds in torch's 64-bit generator state); every list and map has a length bound, every string that
is compiled or searched a size bound. A breach is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seed: as vLLM (n seeded choices use seed + i, still < 2**64)
MAX_ID_CHARS = 256  # an identifier a client sends (user, request_id, prompt_cache_key, ...), as OpenAI's `user`
MAX_PATH_CHARS = 4096  # a path (lora_path), as PATH_MAX
MAX_DETOKENIZE_IDS = 1 << 20  # /detokenize: more than any context's worth of ids

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024  # one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_REGEXES = 4
MAX_STOP_REGEX_CHARS = 512  # one stop_regex pattern
MAX_LOGIT_BIAS = 300  # OpenAI's limit
MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 << 10  # one JSON schema (response_format, guided_json, a tool's parameters), as JSON
MAX_TOOLS_BYTES = 512 << 10  # all tools together, as JSON
MAX_GRAMMAR_CHARS = 64 << 10  # a regex or EBNF grammar, or the grammar built from guided_choice
MAX_GUIDED_CHOICES = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # allowed_token_ids: more than any vocabulary's worth is a mistake
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 128  # the engine compares a word's tokens with the output's tail at each step
MAX_GUIDED_CHOICE_CHARS = 1024
MAX_MESSAGES = 4096
MAX_PROMPTS = 1024  # completions: prompts in one request (the fan-out cap in ServerConfig is usually lower)
MAX_CHAT_TEMPLATE_CHARS = 64 << 10  # a request's own chat_template (only when the operator allows them)
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10  # chat_template_kwargs, as JSON
MAX_DOCUMENTS = 256  # documents for a retrieval-augmented chat template
MAX_DOCUMENTS_BYTES = 1 << 20  # all of them, as JSON (the rendered prompt is bounded by the context after)
MAX_JSON_DEPTH = 64  # nesting of JSON a client sends inside a string or as a schema (parsers, validators recurse)
MAX_REGEX_NESTING = 64  # parenthesis depth of a guided regex (a schema's `pattern` too)
MAX_GRAMMAR_NESTING = 64  # parenthesis depth of an EBNF grammar (xgrammar's own parser stops near 1000)
MAX_GRAMMAR_RULES = 1024  # rules of an EBNF grammar (a hand-written one has tens, a full SQL grammar a few hundred)
# A `{m,n}` count in a regex or grammar, and a schema's minItems, maxLength, ...: past any context's output.
MAX_REPEAT_COUNT = 1 << 20
# Counts multiplied along nested repetitions when one is `{m,n}` (grammar_bounds: the mask cost grows with it).
MAX_NESTED_REPEAT = 16
MAX_ADJACENT_REPEATS = 2  # such counts past MAX_NESTED_REPEAT in a row, no delimiter between (grammar_bounds)
# Stored context, in characters of its items' JSON: what one conversation holds, what a previous_response_id
# chain carries into its next response (each row keeps its whole chain) and what one request's item references
# bring in. Each is loaded, rendered and sent again with every turn that uses it.
MAX_CONTEXT_CHARS = 16 << 20
# The room a turn stored into a conversation reserves for its output before it runs (so a full conversation is
# refused before generating, not after): per output item and per token it may make (its text as escaped JSON;
# with logprobs, each entry and its alternatives), at most TURN_OUTPUT_CHARS (also when no token count is set).
TURN_OUTPUT_CHARS = 1 << 20
OUTPUT_ITEM_CHARS = 256  # an output item's JSON without its text: id, type, status, role or call_id and name
OUTPUT_TOKEN_CHARS = 32
LOGPROB_ENTRY_CHARS = 96  # one {"token", "logprob", "bytes"} entry


def turn_output_chars(items: int, max_tokens: int | None, top_logprobs: int | None = None) -> int:
    """The output room a stored turn reserves (TURN_OUTPUT_CHARS's allowance): `items` output items at most,
    `max_tokens` tokens (None: unbounded here), `top_logprobs` alternatives per token when logprobs are kept."""
    if max_tokens is None:
        return TURN_OUTPUT_CHARS
    per_token = OUTPUT_TOKEN_CHARS + (0 if top_logprobs is None else LOGPROB_ENTRY_CHARS * (1 + top_logprobs))
    return min(TURN_OUTPUT_CHARS, items * OUTPUT_ITEM_CHARS + max_tokens * per_token)


def json_depth(value: Any) -> int:
    """How deep parsed JSON nests (a scalar 0, `[]` 1, `[[]]` 2), level by level: no recursion on a client's value."""
    depth, level = 0, [value]
    while level := [v for v in level if isinstance(v, dict | list)]:
        depth += 1
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def loads_bounded(text: str | bytes) -> Any:
    """json.loads for a client's text; a ValueError (as malformed JSON) when it nests deeper than MAX_JSON_DEPTH:
    past about a thousand levels the parser itself raises RecursionError, and whatever walks the value after
    (a schema validator, json.dumps, a template's tojson) recurses once per level too."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nests deeper than {MAX_JSON_DEPTH} levels")
    return value
