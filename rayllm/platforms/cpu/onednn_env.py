"""oneDNN's cache bounds for the processes that run the model; no torch here, so the model replica can set
its engine child's environment without importing torch itself."""

from __future__ import annotations

from collections.abc import Mapping

# oneDNN keeps the GEMM primitives it builds in two caches keyed by shape, its own and ideep's LRU, 1,024
# each by default. Served, each new step row count is five new shapes, and the caches grew the engine's
# RSS for dozens of soak rounds. 256 holds the last ~50 step sizes: a steady batch never misses, and a
# soak's rebuilt primitives cost a small share of its time (docs/benchmarks.md, soak). Read by oneDNN at
# process start: set in the environment of the processes that run the model (engine child, TP ranks).
ONEDNN_CACHE_CAPACITY = "256"


def onednn_cache_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to `environ` so oneDNN's caches are bounded; none the operator already set."""
    env = {}
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" not in environ and "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in environ:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = ONEDNN_CACHE_CAPACITY  # (DNNL_: oneDNN's older name)
    if "LRU_CACHE_CAPACITY" not in environ:
        env["LRU_CACHE_CAPACITY"] = ONEDNN_CACHE_CAPACITY
    return env
