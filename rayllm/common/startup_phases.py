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


def cold_start_record(model: str, engine_phases: dict[str, float], fetch_s: float, replica_s: float,
                      tokenizer_s: float | None = None, started_at: float | None = None) -> dict:
    """One replica's start-up split into phases (seconds; cuda_graphs_s null where none were captured).
    replica_s is the replica's constructor; Serve marks it ready on its next health poll. engine_imports_s:
    the engine child's imports (null in-process); tokenizer_s runs beside them and the load. started_at:
    the constructor's start (epoch s), process_age_s: how long the replica's process had been up by then."""
    phases = dict(engine_phases)
    return {"event": "cold_start", "model": model,
            "download_s": round(phases.pop("download", 0.0) + fetch_s, 3),
            "engine_imports_s": phases.pop("imports", None), "arch_s": phases.pop("arch", None),
            "load_s": phases.pop("load", None), "kv_cache_s": phases.pop("kv_cache", None),
            "cuda_graphs_s": phases.pop("cuda_graphs", None), "engine_s": phases.pop("engine", None),
            "tokenizer_s": None if tokenizer_s is None else round(tokenizer_s, 3),
            "replica_s": round(replica_s, 3), "started_at": started_at,
            "process_age_s": None if started_at is None else round(started_at - _process_start(), 3)}


def _process_start() -> float:
    import psutil  # a Ray dependency

    return psutil.Process().create_time()
