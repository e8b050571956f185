"""Property-based fuzz of the live API (schemathesis, driven by the app's own OpenAPI schema): whatever
the bodies, no 5xx other than a documented 503 (a full queue, a busy compiler), and the model replica
never restarts. Bounded: a fixed number of examples per operation and a deadline; generated
max_tokens are clipped to a few tokens so that a valid body does not generate for minutes on CPU."""

from __future__ import annotations

import re
import time

import hypothesis
import pytest
import schemathesis

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

# Only the routes that reach the model and the tokenizer (each alias too: its own entry in the schema): the
# others read and write storage and admin state (other tests cover them).
FUZZED_PATHS = ("/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/embeddings",
                "/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/score")
FUZZED = "^(" + "|".join(map(re.escape, FUZZED_PATHS)) + ")$"
DOCUMENTED_503 = {"server_overloaded", "grammar_compiler_busy", "chat_template_busy"}
MAX_TOKENS = 4
# Wall-clock budget for all fuzzed calls: on shared CPUs a case can take seconds (a grammar compile, a
# queue); past the budget the remaining examples are not sent, so the test stays about this long. It is
# shared out route by route (what a fast route leaves goes to the routes after it), so that every route
# is fuzzed however slow the others are.
BUDGET_S = 40.0
ROUTES = len(FUZZED_PATHS)
_started: dict[str, float] = {}  # route -> when its first example was sent
_sent: dict[str, int] = {}  # route -> examples sent


def api_schema() -> schemathesis.BaseSchema:
    import rayllm.serve.ingress  # noqa: F401  (registers the routes on the app)
    from rayllm.serve.routes.http_app import app

    # From the app object, not /openapi.json (off when API keys are on).
    return schemathesis.openapi.from_dict(app.openapi()).include(path_regex=FUZZED)


schema = api_schema()


def _over_budget(route: str) -> bool:
    """Whether `route`'s share is spent: the budget not used by the routes fuzzed before it, split evenly
    between it and the routes still to come."""
    now = time.monotonic()
    first = _started.setdefault(route, now)
    earlier = [t for r, t in _started.items() if r != route]
    used_before = first - min(earlier) if earlier else 0.0  # the routes before it, one after another
    share = (BUDGET_S - used_before) / max(1, ROUTES - len(earlier))
    return now - first > share


def clip(body: object) -> object:
    """Bounds generation, and fixes what the schema cannot express (OpenAI's per-role message rules),
    so that most generated bodies reach the model instead of stopping at those checks."""
    if not isinstance(body, dict):
        return body
    if body.get("max_tokens") is None or isinstance(body["max_tokens"], int) and body["max_tokens"] > MAX_TOKENS:
        body["max_tokens"] = MAX_TOKENS
    if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > MAX_TOKENS:
        body["max_completion_tokens"] = MAX_TOKENS
    for key in ("n", "best_of"):  # fan-out has its own tests (test_abuse); here it would only cost time
        if isinstance(body.get(key), int) and body[key] > 4:
            body[key] = 4
    body.pop("stream", None)  # a stream answers 200 before the model runs: errors would hide in events
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        if not isinstance(m, dict):
            continue
        if m.get("role") != "assistant":
            m.pop("tool_calls", None)
            m.pop("function_call", None)
        if m.get("content") is None and not m.get("tool_calls") and not m.get("function_call"):
            m["content"] = "Hi"
        if m.get("role") == "tool":
            m.setdefault("tool_call_id", "call_0")
        if m.get("role") == "function":
            m.setdefault("name", "f")
    return body


@pytest.fixture(scope="module")
def replica_before(server, auth, llm_stats):
    import httpx

    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=auth, timeout=60)
    return r.headers["x-replica-id"], llm_stats()["num_steps"]


@schema.parametrize()
@hypothesis.settings(max_examples=10, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_api_never_fails_with_a_5xx(case, server, auth, replica_before):
    if _over_budget(case.path):
        return
    _sent[case.path] = _sent.get(case.path, 0) + 1
    case.body = clip(case.body)
    response = case.call(base_url=server, headers=auth, timeout=60)
    if response.status_code >= 500:
        code = (response.json().get("error") or {}).get("code") if "json" in response.headers.get(
            "content-type", "") else None
        assert response.status_code == 503 and code in DOCUMENTED_503, (case.body, response.text[:500])
    assert (response.headers.get("x-replica-id") or [None])[0] in (None, replica_before[0])


def test_replica_survived_the_fuzz(server, auth, llm_stats, replica_before):
    import httpx

    print(f"\nfuzzed examples per route: {_sent}")

    r = httpx.post(f"{server}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=auth, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-replica-id"] == replica_before[0] and llm_stats()["num_steps"] > replica_before[1]


def test_every_post_route_documents_its_body():
    """Every POST route, each alias of one too, has its requestBody in the OpenAPI schema (the routes parse
    their bodies themselves, so FastAPI cannot list them): the fuzz above sends a body only where the schema
    has one, and clients generated from the schema need it. An alias's body is its route's."""
    from rayllm.serve.routes.http_app import app

    posts = {path: ops["post"] for path, ops in app.openapi()["paths"].items() if "post" in ops}
    assert {"/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/score"} <= set(posts)
    assert [path for path, op in posts.items() if "requestBody" not in op] == []
    body = {path: op["requestBody"]["content"]["application/json"]["schema"]["$ref"] for path, op in posts.items()}
    assert body["/v2/rerank"] == body["/rerank"] == body["/v1/rerank"] == "#/components/schemas/RerankRequest"
    assert body["/score"] == body["/v1/score"] == "#/components/schemas/ScoreRequest"
    assert set(FUZZED_PATHS) <= set(posts)
