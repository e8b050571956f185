"""Tracing through the real app (Ray Serve, the model, the tokenizer, SQLite storage): each process exports
its spans with the real OTLP/HTTP exporter to a small OTLP receiver in this test process, which decodes them
with OpenTelemetry's own protobuf messages. One trace per request across the ingress, the tokenizer replica
and the model replica (with the engine's phases), continuing the client's `traceparent`."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.serve.conftest import API_KEY
from tests.serve.ops_apps import MODEL, QUESTION, prio_args

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def traced(request, shared_apps, otlp_receiver) -> str:
    """test_priority_serving.py's app, which exports its spans to the session's OTLP receiver (tracing and
    the priority scheduler coexist, so one app serves both modules)."""
    return shared_apps.get(request, "prio", prio_args(otlp_receiver.server_port))


def test_one_trace_across_ingress_tokenizer_and_model(traced, otlp_receiver):
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    xrid = f"trace-test-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "store": True}
    headers = AUTH | {"traceparent": f"00-{trace_id}-{client_span}-01", "x-request-id": xrid}
    with httpx.stream("POST", f"{traced}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        chunks = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    last = json.loads(chunks[-1][6:])
    usage, rid = last["usage"], last["id"]
    assert usage["completion_tokens"] == 4

    spans = otlp_receiver.wait_for(lambda s: s["trace"] == trace_id, {
        "POST /v1/chat/completions", "validate", "render", "tokenizer.render", "llm.generate", "engine.queue",
        "engine.prefill", "engine.decode", "storage.write"})
    one = {name: only for name, (only,) in spans.items()}  # one span of each: one request, one choice
    root = one["POST /v1/chat/completions"]
    assert root["parent"] == client_span  # the client's traceparent is honoured
    parents = {"validate": root, "render": root, "storage.write": root, "llm.generate": root,
               "tokenizer.render": one["render"], "engine.queue": one["llm.generate"],
               "engine.prefill": one["llm.generate"], "engine.decode": one["llm.generate"]}
    for name, parent in parents.items():
        assert one[name]["parent"] == parent["id"], name
        assert parent["start"] <= one[name]["start"] <= one[name]["end"], name  # one wall clock on this node
    for name in ("validate", "render", "storage.write"):  # the ingress's own: inside the request's span
        assert one[name]["end"] <= root["end"]
    llm, queue, prefill, decode = (one[n] for n in ("llm.generate", "engine.queue", "engine.prefill",
                                                    "engine.decode"))
    assert queue["end"] == prefill["start"] and prefill["end"] == decode["start"] and decode["end"] <= llm["end"]

    # Three processes: the ingress, the tokenizer replica, the model replica (the engine's child exports nothing).
    component = {name: s["resource"]["rayllm.component"] for name, s in one.items()}
    assert {component[n] for n in ("POST /v1/chat/completions", "validate", "render", "storage.write")} == {"ingress"}
    assert component["tokenizer.render"] == "tokenizer"
    assert {component[n] for n in ("llm.generate", "engine.queue", "engine.prefill", "engine.decode")} == {"llm"}
    pids = {one[n]["resource"]["process.pid"] for n in ("validate", "tokenizer.render", "llm.generate")}
    assert len(pids) == 3 and root["resource"]["service.name"] == "rayllm-test"

    for span in (root, llm):  # the request's ids, model and token counts, as the client saw them
        attrs = span["attrs"]
        assert attrs["gen_ai.response.id"] == rid and attrs["rayllm.x_request_id"] == xrid
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert root["attrs"]["http.response.status_code"] == 200
    assert prefill["attrs"]["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert decode["attrs"]["gen_ai.usage.output_tokens"] == 4


def test_new_traces_per_choice_phases_and_a_client_that_samples_out(traced, otlp_receiver):
    unsampled = uuid.uuid4().hex
    r = httpx.post(f"{traced}/v1/chat/completions", headers=AUTH | {"traceparent": f"00-{unsampled}-"
                   f"{uuid.uuid4().hex[:16]}-00"}, json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
                   timeout=120)
    assert r.status_code == 200
    r = httpx.post(f"{traced}/v1/completions", headers=AUTH, timeout=120, json={
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "n": 2, "temperature": 1,
        "seed": 1, "ignore_eos": True})
    assert r.status_code == 200
    rid = r.json()["id"]
    (llm,) = otlp_receiver.wait_for(lambda s: s["attrs"].get("gen_ai.response.id") == rid, {"llm.generate"})[
        "llm.generate"]
    spans = otlp_receiver.wait_for(lambda s: s["trace"] == llm["trace"], {
        "POST /v1/completions", "validate", "llm.generate", "engine.queue", "engine.prefill", "engine.decode"})
    (root,) = spans["POST /v1/completions"]
    assert root["parent"] == "" and llm["parent"] == root["id"]  # no traceparent: a trace of its own
    assert "render" not in spans  # a completion renders no chat template
    for phase in ("engine.queue", "engine.prefill", "engine.decode"):  # one per choice
        assert sorted(s["attrs"]["rayllm.choice"] for s in spans[phase]) == [0, 1]
        assert all(s["parent"] == llm["id"] for s in spans[phase])
    assert root["attrs"]["gen_ai.usage.output_tokens"] == 6 == llm["attrs"]["gen_ai.usage.output_tokens"]
    # The first request's spans went out before the second's, through the same exporters: none were kept.
    assert not [s for s in otlp_receiver.spans if s["trace"] == unsampled]


def engine_phases(spans: dict[str, list[dict]], choice: int, llm: dict) -> tuple[dict, dict, dict]:
    """One choice's queue, prefill and decode spans: children of `llm`, back to back inside its interval."""
    queue, prefill, decode = ({s["attrs"]["rayllm.choice"]: s for s in spans[name]}[choice]
                              for name in ("engine.queue", "engine.prefill", "engine.decode"))
    for s in (queue, prefill, decode):
        assert s["parent"] == llm["id"] and llm["start"] <= s["start"] <= s["end"] <= llm["end"]
    assert queue["end"] == prefill["start"] and prefill["end"] == decode["start"]
    return queue, prefill, decode


def test_a_choice_ended_by_a_stop_string_keeps_its_engine_phases(traced, otlp_receiver):
    """A stop string is matched beside the engine, which then aborts the sequence: the choice's phases come
    with the abort's acknowledgement, and its decode ends at the abort, marked `stop_string`. The request's
    other choice runs to its length as usual; both sit inside llm.generate."""
    prompts = ["The capital of France is", "1, 2, 3, 4, 5,"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{traced}/v1/completions", headers=AUTH, json=body, timeout=120)
    assert r.status_code == 200
    free = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    # A word early in the first answer (greedy, batch-invariant: the same again) that the second never says.
    stop = next(w for w in free[0][: len(free[0]) // 3].split() if len(w) >= 3 and w not in free[1])

    trace_id = uuid.uuid4().hex
    headers = AUTH | {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    r = httpx.post(f"{traced}/v1/completions", headers=headers, json=body | {"stop": [stop]}, timeout=120)
    assert r.status_code == 200
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices] == ["stop", "length"] and stop not in choices[0]["text"]

    spans = otlp_receiver.wait_for(lambda s: s["trace"] == trace_id, {
        "llm.generate", "engine.queue", "engine.prefill", "engine.decode"})
    (llm,) = spans["llm.generate"]
    assert all(len(spans[n]) == 2 for n in ("engine.queue", "engine.prefill", "engine.decode"))
    *_, stopped = engine_phases(spans, 0, llm)
    *_, ran = engine_phases(spans, 1, llm)
    assert stopped["attrs"]["rayllm.aborted"] == "stop_string" and "rayllm.aborted" not in ran["attrs"]
    assert 0 < stopped["attrs"]["gen_ai.usage.output_tokens"] < 40 == ran["attrs"]["gen_ai.usage.output_tokens"]
    assert sorted(llm["attrs"]["gen_ai.response.finish_reasons"]) == ["length", "stop"]


def test_a_client_that_leaves_mid_stream_keeps_its_engine_phases(traced, otlp_receiver):
    """The client goes away: the replica's generation is cancelled and its choice aborted in the engine; the
    decode span ends at that abort, marked `cancelled`, inside llm.generate (which says `abort`)."""
    trace_id = uuid.uuid4().hex
    headers = AUTH | {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to one thousand."}],
            "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{traced}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # leaving the block closes the connection mid-stream

    spans = otlp_receiver.wait_for(lambda s: s["trace"] == trace_id, {
        "llm.generate", "engine.queue", "engine.prefill", "engine.decode"})
    (llm,) = spans["llm.generate"]
    *_, decode = engine_phases(spans, 0, llm)
    assert decode["attrs"]["rayllm.aborted"] == "cancelled" and llm["attrs"]["rayllm.outcome"] == "abort"
    assert 0 < decode["attrs"]["gen_ai.usage.output_tokens"] < 900
