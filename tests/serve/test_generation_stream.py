"""rayllm.serve.generation_stream: the ingress's one loop over a model call (here an async generator of delta
batches, as the Serve handle streams them): the request timeout, the replica header, storage before the end,
and the metrics each way a request can end."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rayllm.protocol.choice_state import GenerationState
from rayllm.protocol.errors import APIError
from rayllm.protocol.io_struct import GenerationDelta
from rayllm.protocol.sse import SSE_DONE, ChatFormat
from rayllm.serve.generation_stream import Generation
from rayllm.serve.metrics import ServerMetrics


def delta(i: int, text: str, finish: str | None = None, **kw: Any) -> GenerationDelta:
    return GenerationDelta(index=0, text=text, token_ids=[i], logprobs=None, finish_reason=finish, matched_stop=None,
                           prompt_tokens=3, cached_tokens=0, completion_tokens=i, **kw)


async def model(batches: list, pause_s: float = 0.0) -> Any:
    for b in batches:
        await asyncio.sleep(pause_s)
        yield b


def generation(call: Any, metrics: ServerMetrics, timeout_s: float | None = None, on_complete=None) -> Generation:
    fmt = ChatFormat(GenerationState(), request_id="r", model="m", created=1, include_usage=True)
    return Generation(call, fmt, metrics=metrics, model="m", t0=time.monotonic(), timeout_s=timeout_s,
                      retry_after_s=1.0, on_complete=on_complete)


def outcomes(metrics: ServerMetrics) -> dict[str, float]:
    fams = text_string_to_metric_families(metrics.render().decode())
    return {s.labels["finished_reason"]: s.value for f in fams for s in f.samples
            if s.name == "vllm:request_success_total"}


async def test_stream_stores_before_done_and_carries_the_replica_id():
    metrics, seen = ServerMetrics(), []

    async def save(state: GenerationState) -> None:
        seen.append(state.sorted_choices()[0].text)

    gen = generation(model([[delta(1, "Hel", replica_id="rep-1")], [delta(2, "lo", "stop")]]), metrics,
                     on_complete=save)
    await gen.start()
    assert gen.headers == {"x-replica-id": "rep-1"}
    writes = []
    async for w in gen.events():
        writes.append(w)
        assert not seen or w.endswith(SSE_DONE)  # nothing after the store but the tail
    assert seen == ["Hello"] and writes[-1].endswith(SSE_DONE)
    assert outcomes(metrics) == {"stop": 1.0}


async def test_a_timeout_before_the_first_token_is_an_http_error():
    metrics = ServerMetrics()
    gen = generation(model([[delta(1, "late")]], pause_s=1.0), metrics, timeout_s=0.05)
    with pytest.raises(APIError) as err:
        await gen.start()
    assert err.value.status_code == 504 and err.value.code == "request_timeout"
    assert outcomes(metrics) == {"error": 1.0}


async def test_a_failed_store_after_the_last_delta_is_an_error_event():
    async def save(state: GenerationState) -> None:
        raise APIError(503, "storage down", code="storage_unavailable")

    metrics = ServerMetrics()
    gen = generation(model([[delta(1, "a", "stop")]]), metrics, on_complete=save)
    await gen.start()
    body = "".join([w async for w in gen.events()])
    events = [e for e in body.split("\n\n") if e]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "storage_unavailable"
    assert events[-1] + "\n\n" == SSE_DONE and "usage" not in body  # no usage chunk: the response failed
    assert outcomes(metrics) == {"stop": 1.0}  # the generation itself finished


async def test_a_client_gone_mid_stream_is_an_abort():
    metrics = ServerMetrics()
    gen = generation(model([[delta(1, "a")], [delta(2, "b")], [delta(3, "c", "stop")]]), metrics)
    await gen.start()
    events = gen.events()
    await anext(events)
    await events.aclose()
    assert outcomes(metrics) == {"abort": 1.0}
