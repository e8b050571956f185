"""Where a replica's cold start goes: download, load to device, KV cache sizing and allocation, CUDA-graph
capture. Each phase adds its wall time to this process's record; the engine hands the record to the
serving side, which logs it as one structured line (rayllm.serve.llm_server)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_phases: dict[str, float] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.perf_counter() - t0


def recorded() -> dict[str, float]:
    """The phases so far: {name: seconds}. `kv_cache` excludes `cuda_graphs`, which runs inside it."""
    out = dict(_phases)
    if "kv_cache" in out and "cuda_graphs" in out:
        out["kv_cache"] -= out["cuda_graphs"]
    return {k: round(v, 3) for k, v in out.items()}
