"""Per-owner in-flight generations at the ingress: with `scheduler.max_running_share` set, one API key's owner
may hold at most its share of the model deployment's Serve queue (max_ongoing_requests + max_queued_requests),
so its requests parked in the engine cannot fill that queue and make everyone else's requests 503."""

# No `from __future__ import annotations`, like the ingress: this runs inside the Serve replica.

import math
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from typing import Any

from rayllm.protocol.errors import APIError
from rayllm.serve.config import ServerConfig

# The model deployment's own defaults (LLMDeployment in rayllm/serve/llm_server.py; a test checks they agree).
LLM_MAX_ONGOING_REQUESTS = 256
LLM_MAX_QUEUED_REQUESTS = 512


def owner_cap(share: float, options: Mapping[str, Any]) -> int | None:
    """In-flight requests one owner may have on this ingress replica: ceil(share x (max_ongoing_requests +
    max_queued_requests)) of the model deployment (an unbounded queue, -1, counts as none); None at share 1."""
    if share >= 1.0:
        return None
    ongoing = options.get("max_ongoing_requests", LLM_MAX_ONGOING_REQUESTS)
    queued = options.get("max_queued_requests", LLM_MAX_QUEUED_REQUESTS)
    return max(1, math.ceil(share * (ongoing + max(queued, 0))))


class RateLimited(APIError):
    """An owner past its in-flight cap: OpenAI's 429 rate_limit_exceeded, with Retry-After."""

    def __init__(self, cap: int, retry_after_s: float) -> None:
        super().__init__(429, f"This API key has {cap} requests in flight for this model, its share of the "
                         "server's queue (scheduler.max_running_share); retry after the time given in the "
                         "Retry-After header.", code="rate_limit_exceeded")
        self.headers = {"Retry-After": str(max(1, round(retry_after_s)))}


class OwnerLimits:
    """In-flight generations per (model, owner) on this ingress replica; requests without a key (keys off)
    are never capped, as in the engine."""

    def __init__(self, caps: Mapping[str, int | None], retry_after_s: float) -> None:
        self.caps = {model: cap for model, cap in caps.items() if cap is not None}
        self.retry_after_s = retry_after_s
        self.in_flight: Counter[tuple[str, str]] = Counter()

    @classmethod
    def of(cls, config: ServerConfig) -> "OwnerLimits":
        # Each model's deployment options as the app builds them (rayllm.serve.builder.llm_deployment_options);
        # a Serve config file's `deployments` section, which this replica cannot see, is not counted.
        return cls({entry.name: owner_cap(entry.engine.scheduler.max_running_share,
                                          config.llm_deployment_options | entry.deployment)
                    for entry in config.models}, config.retry_after_s)

    def enter(self, model: str, owner: str | None) -> Callable[[], None]:
        """Counts one request of `owner` (a 429 past its cap); returns its release, which may be called twice."""
        cap = self.caps.get(model)
        if cap is None or not owner:
            return lambda: None
        key = (model, owner)
        if self.in_flight[key] >= cap:
            raise RateLimited(cap, self.retry_after_s)
        self.in_flight[key] += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight[key] -= 1
                if self.in_flight[key] <= 0:
                    del self.in_flight[key]

        return release


def released(events: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    """A stream's events, its owner's slot released when it ends, fails or the client leaves; also when it is
    collected without having started (a client gone before the first write: no `finally` runs then)."""
    stream = _released(events, release)
    weakref.finalize(stream, release)
    return stream


async def _released(events: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    try:
        async with aclosing(events) as inner:  # closed here at once: the model call is cancelled as before
            async for event in inner:
                yield event
    finally:
        release()
