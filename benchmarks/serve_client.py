"""The HTTP side of serve_bench.py: one streamed chat request, a closed-loop sweep point, and the
mid-stream scenario (streams decoding while a ~1,000-token prompt arrives)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
from serve_prompts import messages_for
from serve_stats import Result, spread_tokens, summarize
from tqdm import tqdm


async def one_request(client: httpx.AsyncClient, base: str, model: str, messages: list[dict],
                      max_tokens: int, first_token: asyncio.Event | None = None) -> Result:
    """`first_token` is set when the first content chunk arrives (or when the request ends without one)."""
    try:
        return await _one_request(client, base, model, messages, max_tokens, first_token)
    finally:
        if first_token is not None:
            first_token.set()


async def _one_request(client: httpx.AsyncClient, base: str, model: str, messages: list[dict],
                       max_tokens: int, first_token: asyncio.Event | None) -> Result:
    body = {"model": model, "messages": messages, "stream": True, "temperature": 0.0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    res = Result()
    times: list[float] = []
    chars: list[int] = []
    usage = None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                    return res
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if first_token is not None:
                            first_token.set()
                        times.append(now)
                        chars.append(len(text))
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res
    res.end = time.perf_counter()
    if usage is None:  # server ignores stream_options.include_usage: count content chunks instead
        res.counted_chunks = True
        res.completion_tokens = len(times)
    else:
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    if times:
        res.ttft = times[0] - t0
        per_chunk = spread_tokens(chars, res.completion_tokens)
        if len(times) > 1 and res.completion_tokens > 1:
            res.tpot = (times[-1] - times[0]) / (res.completion_tokens - 1)
        for i in range(1, len(times)):
            gap, k = times[i] - times[i - 1], per_chunk[i]
            res.itl.extend([gap / k] * k)
    res.ok = True
    return res


async def run_point(client: httpx.AsyncClient, base: str, model: str, prompts: list[list[dict]],
                    concurrency: int, max_tokens: int, cap_s: float, bar: tqdm) -> dict:
    """`concurrency` closed-loop workers share the fixed prompt list; nothing starts after the cap."""
    queue = list(enumerate(prompts))
    results: list[Result] = []
    t0 = time.perf_counter()
    deadline = t0 + cap_s

    async def worker() -> None:
        while queue and time.perf_counter() < deadline:
            _, msgs = queue.pop(0)
            try:
                r = await asyncio.wait_for(one_request(client, base, model, msgs, max_tokens),
                                           max(0.1, deadline - time.perf_counter()))
            except asyncio.TimeoutError:
                r = Result(error=f"per-point cap of {cap_s:.0f}s reached", end=time.perf_counter())
            results.append(r)
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    bar.update(len(queue))  # never started: the cap was reached
    ends = [r.end for r in results if r.end]
    wall = (max(ends) if ends else time.perf_counter()) - t0
    out = summarize(results, len(prompts), wall, timed_out=bool(queue) or time.perf_counter() > deadline)
    return out


async def run_midstream(client: httpx.AsyncClient, base: str, model: str, concurrency: int, rounds: int,
                        salt: int, cap_s: float, bar: tqdm) -> list[dict]:
    """`concurrency` short chat streams (64 tokens at most) start together, `rounds` times without and
    `rounds` times with one ~1,000-token prompt (32 new tokens) sent once every stream has its first
    token; the two alternate. Returns the two stats dicts (the streams' ITL p99 is the figure to read)."""
    results: dict[bool, list[Result]] = {False: [], True: []}
    longs: list[Result] = []
    walls = {False: 0.0, True: 0.0}
    for r in range(rounds):
        for with_long in (False, True):
            events = [asyncio.Event() for _ in range(concurrency)]
            prompts = messages_for("short", concurrency)
            t0 = time.perf_counter()
            tasks = [asyncio.create_task(asyncio.wait_for(one_request(client, base, model, m, 64, e), cap_s))
                     for m, e in zip(prompts, events, strict=True)]
            if with_long:
                try:
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), cap_s)
                    longs.append(await asyncio.wait_for(one_request(
                        client, base, model, messages_for("long", 1, salt=salt * 1009 + r)[0], 32), cap_s))
                except asyncio.TimeoutError:
                    longs.append(Result(error=f"cap of {cap_s:.0f}s reached"))
                bar.update(1)
            for out in await asyncio.gather(*tasks, return_exceptions=True):
                results[with_long].append(out if isinstance(out, Result) else Result(error=f"{type(out).__name__}"))
            walls[with_long] += time.perf_counter() - t0
            bar.update(concurrency)
    lines = []
    for with_long in (False, True):
        stats = summarize(results[with_long], concurrency * rounds, walls[with_long], timed_out=False)
        stats["long_prompt_mid_stream"] = with_long
        if with_long:
            ok = [x for x in longs if x.ok and x.ttft is not None]
            stats.update(long_requests=len(longs), long_errors=len(longs) - len(ok),
                         long_ttft_p50_s=round(statistics.median(x.ttft for x in ok), 4) if ok else None,
                         long_prompt_tokens_mean=round(statistics.mean(x.prompt_tokens for x in ok), 1) if ok else None)
        lines.append(stats)
    return lines
