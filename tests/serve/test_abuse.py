"""Issue 17: requests built to overflow, stall or fan out answer a 4xx naming the field, within a
generous bound, and the model replica that served before serves after (same x-replica-id, engine not
restarted: its step counter only grows). All against the real Ray Serve app and model.

Most tests use the session app (default bounds: the secure defaults). One extra app, `abuse` (ops_apps.ABUSE,
shared with test_embeddings.py), turns on request chat templates, a 2 s request timeout and a cap on the
tokens a request may ask for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve.conftest import GRAMMAR_COMPILE_TIMEOUT_S
from tests.serve.ops_apps import ABUSE, MODEL

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

QUESTION = [{"role": "user", "content": "Say hello."}]
BOUND_S = 60  # generous: every refusal here takes milliseconds; a stalled replica takes forever


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0} | kw


_HTTP: list[httpx.Client] = []  # the module's one client: each new one builds an SSL context (~20 ms of CPU)


@pytest.fixture(scope="module", autouse=True)
def http_client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=BOUND_S) as http:
        _HTTP.append(http)
        yield http
        _HTTP.clear()


def replica_state(base: str, headers: dict, stats) -> tuple[str, int]:
    """The serving replica's id and its engine's step count (a restarted engine starts again from 0)."""
    r = _HTTP[0].post(f"{base}/v1/chat/completions", json=chat(max_tokens=1), headers=headers)
    assert r.status_code == 200, r.text
    return r.headers["x-replica-id"], stats()["num_steps"]


# App URL -> (position in the session of the test whose closing check read it, replica id, step count).
_CHECKED: dict[str, tuple[int, str, int]] = {}


def checked_replica(request: pytest.FixtureRequest, base: str, headers: dict, stats) -> Iterator[None]:
    """The same model replica serves before and after the test, its engine not restarted. The state before
    is what the closing check of the test just before read, when that test checked this app (nothing else
    sends to it between two tests of this module): not read twice."""
    here = request.session.items.index(request.node)
    last = _CHECKED.pop(base, None)
    rid, steps = last[1:] if last is not None and last[0] == here - 1 else replica_state(base, headers, stats)
    yield
    rid_after, steps_after = replica_state(base, headers, stats)  # its request runs at least one step
    assert rid_after == rid and steps_after > steps, "the model replica was replaced or its engine restarted"
    _CHECKED[base] = (here, rid_after, steps_after)


@pytest.fixture
def same_replica(request, server, auth, llm_stats) -> Iterator[None]:
    yield from checked_replica(request, server, auth, llm_stats)


def post(server: str, auth: dict, path: str, body: dict, **kw) -> httpx.Response:
    t0 = time.monotonic()
    r = _HTTP[0].post(f"{server}{path}", json=body, headers=auth, **kw)
    assert time.monotonic() - t0 < BOUND_S
    return r


def refused(r: httpx.Response, param: str, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param or (err["param"] or "").startswith(param + "."), err
    return err


# ---- item 1: numbers the engine cannot hold ----------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"top_k": 9223372036854775808}, "top_k"),  # the request: took the replica down for 33 s
    ({"top_k": 2**31}, "top_k"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),  # seed + 1 for the second choice overflows 64 bits
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_completion_tokens": 2**40}, "max_completion_tokens"),
    ({"min_tokens": 2**40}, "min_tokens"),
    ({"logit_bias": {"99999999999999999999": 5}}, "logit_bias"),
    ({"logit_bias": {"49152": 5}}, "logit_bias"),  # one past SmolLM2's vocabulary
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
    ({"n": 2**40}, "n"),
    ({"temperature": 1e308}, "temperature"),
])
def test_out_of_range_numbers_are_400s_naming_the_field(server, auth, same_replica, body, param):
    refused(post(server, auth, "/v1/chat/completions", chat(**body)), param)


@pytest.mark.parametrize("body, param", [
    ({"best_of": 2**40}, "best_of"),
    ({"logprobs": 2**40}, "logprobs"),
    ({"prompt": [2**40]}, "prompt"),
    ({"prompt": [[1, 2], [49152]]}, "prompt"),
    ({"prompt": [2**40, 5], "echo": True}, "prompt"),  # echo decodes the ids: past int32 the tokenizer overflowed
    ({"prompt": [1, 49152], "echo": True}, "prompt"),
    ({"metadata": {"k": "v" * 600}}, "metadata"),  # stored with a chat completion: bounded as OpenAI's
    ({"user": "u" * 300}, "user"),
])
def test_completions_numbers_out_of_range(server, auth, same_replica, body, param):
    refused(post(server, auth, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2} | body), param)


@pytest.mark.parametrize("body", [{"top_k": 2**31 - 1}, {"seed": 2**63 - 1, "n": 2, "temperature": 1},
                                  {"seed": -(2**63), "n": 3, "temperature": 1}])
def test_largest_accepted_values_generate(server, auth, same_replica, body):
    """The bounds' edges are accepted and served: top_k past the vocabulary is no top-k, seeds at the
    ends of the 64-bit range with n choices (seed + i) run."""
    r = post(server, auth, "/v1/chat/completions", chat(**body))
    assert r.status_code == 200, r.text
    assert all(c["finish_reason"] in ("length", "stop") for c in r.json()["choices"])


# ---- item 2: stop_regex --------------------------------------------------------------------------------


def a_token(server: str, auth: dict) -> int:
    r = _HTTP[0].post(f"{server}/tokenize", json={"model": MODEL, "prompt": "a", "add_special_tokens": False},
                      headers=auth)
    (tid,) = r.json()["tokens"]
    return tid


def test_catastrophic_stop_regex_streams_forced_as_quickly(server, auth, same_replica):
    """`(a+)+b` over 40 forced a's: Python's re would backtrack for hours on the last steps (24 took
    2.5 s, each one more doubles it); RE2 does not. The bound is loose: shared CPUs generate slowly."""
    body = chat(max_tokens=40, stream=True, ignore_eos=True, stop_regex=["(a+)+b", "(x+x+)+y"],
                logit_bias={str(a_token(server, auth)): 100})
    t0 = time.monotonic()
    with _HTTP[0].stream("POST", f"{server}/v1/chat/completions", json=body, headers=auth, timeout=5 * BOUND_S) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert time.monotonic() - t0 < 5 * BOUND_S and lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert set(text) == {"a"} and len(text) >= 40
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


@pytest.mark.parametrize("stop_regex", [r"(\w)\1", r"(?<=a)b", ["a"] * 5, "a" * 600])
def test_stop_regex_outside_re2_or_the_bounds_is_refused(server, auth, same_replica, stop_regex):
    refused(post(server, auth, "/v1/chat/completions", chat(stop_regex=stop_regex)), "stop_regex")


# ---- items 3, 5: chat templates, large maps and lists ------------------------------------------------------


BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 40}
                                               for i in range(2000)}}


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "s" * 2000}, "stop"),
    ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BIG_SCHEMA}}},
     "response_format"),
    ({"guided_json": BIG_SCHEMA}, "guided_json"),
    ({"guided_choice": [f"c{i}" for i in range(300)]}, "guided_choice"),
    ({"guided_choice": ["c" * 2000]}, "guided_choice"),
    ({"regex": "a" * 70000}, "regex"),
    ({"messages": [{"role": "user", "content": "hi"}] * 5000}, "messages"),
    ({"chat_template_kwargs": {"k": "v" * 20000}}, "chat_template_kwargs"),
])
def test_large_maps_and_lists_are_400s_naming_the_field(server, auth, same_replica, body, param):
    refused(post(server, auth, "/v1/chat/completions", chat(**body)), param)


# ---- item 4: fan-out ---------------------------------------------------------------------------------------


def test_fan_out_is_capped(server, auth, same_replica):
    r = post(server, auth, "/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 500, "n": 16, "max_tokens": 1})
    assert refused(r, "prompt")["code"] == "too_many_sequences"
    r = post(server, auth, "/v1/chat/completions", chat(n=100))
    assert "max_sequences_per_request" in refused(r, "n")["message"]


# ---- item 6: grammar compilation ----------------------------------------------------------------------------


async def test_slow_grammar_compile_is_a_400_and_health_stays_green(server, auth, same_replica):
    slow = "root ::= " + " ".join("[a-z]*" for _ in range(3000))  # 21 KB; xgrammar takes ~40 s
    async with httpx.AsyncClient(timeout=BOUND_S, headers=auth) as http:
        req = asyncio.create_task(http.post(f"{server}/v1/chat/completions", json=chat(ebnf=slow)))
        await asyncio.sleep(1)
        for _ in range(3):  # health checks use other threads than the compile
            t0 = time.monotonic()
            assert (await http.get(f"{server}/health")).status_code == 200
            assert time.monotonic() - t0 < 5
        r = await req
    err = refused(r, "ebnf")
    assert f"more than this server's limit of {GRAMMAR_COMPILE_TIMEOUT_S} s of CPU time" in err["message"]  # the app's bound


# ---- item 14: the body is counted while it arrives ---------------------------------------------------------


def test_chunked_body_over_the_limit_is_413(server, auth, same_replica):
    def chunks():  # no Content-Length: 9 MiB in 64 KiB chunks
        yield b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(9 * 16):
            yield b"x" * (64 << 10)
        yield b'"}]}'

    # A client of its own: the server answers before reading the whole body, and that connection is not reused.
    r = httpx.post(f"{server}/v1/chat/completions", content=chunks(), headers=auth | {"content-type": "application/json"},
                   timeout=BOUND_S)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ---- nesting: JSON and regexes deeper than the parsers that walk them ----------------------------------------

DEEP = "[" * 5000 + "]" * 5000


async def test_deeply_nested_json_fails_no_one_else(server, auth, same_replica):
    """Tool-call arguments 5000 levels deep were a RecursionError in the tokenizer replica's render (a 500 that also
    closed the render channel under other clients' renders): they render as the client's text now."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    history = [{"role": "user", "content": "Call f."}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "done"}, *QUESTION]
    async with httpx.AsyncClient(timeout=BOUND_S, headers=auth) as http:
        # 5000 tokens of brackets: the last 1024 of the prompt fit the context.
        bodies = [chat(messages=history, truncate_prompt_tokens=1024), chat()]
        nested, normal = await asyncio.gather(*(http.post(f"{server}/v1/chat/completions", json=b) for b in bodies))
    assert nested.status_code == 200 and nested.json()["usage"]["prompt_tokens"] == 1024, nested.text
    assert normal.status_code == 200, normal.text
    for body, param in (({"guided_json": DEEP}, "guided_json"),
                        ({"structured_outputs": {"structural_tag": DEEP}}, "structured_outputs.structural_tag"),
                        ({"guided_regex": "(" * 3000 + "a" + ")" * 3000}, "guided_regex")):
        refused(post(server, auth, "/v1/chat/completions", chat(**body)), param)


# ---- the `abuse` app: request templates on, a 2 s request timeout, a requested-tokens cap --------------------

PLAIN = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def abuse(request, shared_apps, http_client):
    """ops_apps.ABUSE, shared with test_embeddings.py's request-timeout test (conftest.SharedApps)."""
    url = shared_apps.get(request, "abuse", ABUSE)
    # Warm: a new replica's first requests pay one-time costs, which may meet its 2 s timeout when loaded.
    for _ in range(5):
        if _HTTP[0].post(f"{url}/v1/chat/completions", json=chat(max_tokens=1)).status_code == 200:
            break
    return url


@pytest.fixture(scope="module")
def abuse_handle(abuse):
    from ray import serve

    return serve.get_deployment_handle("llm", app_name="abuse")


@pytest.fixture(scope="module")
def abuse_stats(abuse_handle):
    return lambda: abuse_handle.stats.remote().result()


@pytest.fixture
def abuse_same_replica(request, abuse, abuse_stats) -> Iterator[None]:
    yield from checked_replica(request, abuse, {}, abuse_stats)


def test_request_chat_template_when_allowed(abuse, abuse_same_replica):
    r = post(abuse, {}, "/v1/chat/completions", chat(chat_template=PLAIN, max_tokens=3))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
    for template, code in [("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                            "chat_template_timeout"),
                           ("{{ 'x' * 10**9 }}", None),  # memory, output or time bound
                           ("x" * 70000, None)]:
        err = refused(post(abuse, {}, "/v1/chat/completions", chat(chat_template=template)), "chat_template")
        assert code is None or err["code"] == code
    # The sandbox's child was replaced after the refusals: templates render again.
    assert post(abuse, {}, "/v1/chat/completions", chat(chat_template=PLAIN, max_tokens=3)).status_code == 200


def test_requested_tokens_are_capped(abuse, abuse_same_replica):
    err = refused(post(abuse, {}, "/v1/chat/completions", chat(n=8, max_tokens=600)), "max_tokens")
    assert err["code"] == "too_many_requested_tokens"
    err = refused(post(abuse, {}, "/v1/chat/completions", chat(n=8, max_tokens=None)), "max_tokens")
    assert "default" in err["message"]


async def test_504_before_the_first_token_cancels_the_generation(fp32_server, auth, abuse, abuse_handle,
                                                                 abuse_same_replica, hf_tokenizer):
    """Eight long generations fill the engine (max_num_seqs 8); they go to the model deployment itself, so
    the app's request timeout never cuts them, and their length comes from the pace measured now (four
    timeouts' worth of steps). A ninth request, through HTTP, waits behind them and gets a 504 before its
    first token, and its generation is aborted at once: it leaves the engine's queue while the eight run."""
    from rayllm.protocol.io_struct import GenerateRequest, StopOptions
    from rayllm.schema.sampling_params import SamplingParams
    from tests.serve.ops_apps import Pace

    timeout_s = ABUSE["request_timeout_s"]
    # The fp32 app's pace (conftest.fp32_server: the abuse app's model and numerics, without its timeout).
    pace = Pace(fp32_server, headers=auth)
    tokens = pace.tokens_for(4 * timeout_s, cap=900)
    ids = hf_tokenizer("Count from one to one thousand.").input_ids
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)

    streams = []

    async def fill(i: int) -> None:
        req = GenerateRequest(request_id=f"filler-{i}", prompts=[ids], params=params, stop=StopOptions())
        streams.append(abuse_handle.options(stream=True).generate.remote(req))
        async for _ in streams[-1]:
            pass

    async def stats() -> dict:
        return await abuse_handle.stats.remote()

    fillers = [asyncio.create_task(fill(i)) for i in range(8)]
    try:
        deadline = time.monotonic() + pace.bound(8)
        while (await stats())["num_running"] < 8:  # the engine is full: the ninth waits
            assert time.monotonic() < deadline, await stats()
            await asyncio.sleep(0.02)
        ninth = chat(max_tokens=8, stream=True)
        async with httpx.AsyncClient(timeout=BOUND_S) as http:
            t0 = time.monotonic()
            r = await http.post(f"{abuse}/v1/chat/completions", json=ninth)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert time.monotonic() - t0 < timeout_s + pace.bound(8)
        s = await stats()
        assert s["num_running"] == 8 and s["num_waiting"] == 0, s  # the ninth aborted, the eight still run
        assert not any(f.done() for f in fillers)
    finally:
        for stream in streams:
            stream.cancel()  # as the ingress does when a client leaves: the replica aborts the generation
        for f in fillers:
            f.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
    deadline = time.monotonic() + pace.bound(64)
    while (s := await stats())["num_running"] + s["num_waiting"] and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert s["num_running"] == s["num_waiting"] == 0, s  # leaving a stream aborts its generation
