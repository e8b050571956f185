"""`python -m rayllm.serve.prewarm [CONFIG]`: fill this node's start-up caches for a Serve config's models.

`make install` runs it on cluster.yaml, so that the first `make serve` after an install starts as fast as
every later one: a replica's first start on a machine otherwise builds the tokenizer's snapshot through
transformers (in the tokenizer and model replicas at once) and, on CPU, dequantizes the GGUF into the weight
cache, which took the first start from ~14 s to ~22 s on 2 cores (docs/benchmarks.md, cold start). What it
fills is what a replica would write itself, under the same keys: the tokenizer snapshot
(rayllm.serve.chat_template), and for CPU models the C kernels' build (rayllm.platforms.cpu.kernels) and, where
the weight cache applies (a GGUF loaded dense at tensor_parallel_size 1), its entry (rayllm.loader.weight_cache),
by building the engine once in this process. Remote models (Hugging Face ids, object-store URIs) are left to the replicas, which
fetch them at start (an install does not download models). Each model's failure is reported and skipped:
the caches are an optimisation, and the replica builds whatever is missing. The Dockerfile runs it with
`--tokenizer-only`: the weight cache's key includes the CPU's flags, which an image build cannot know.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

import yaml

from rayllm.common.errors import first_line
from rayllm.loader import model_sources
from rayllm.loader.model_files import resolve_model_path
from rayllm.serve.builder import with_resolved_device
from rayllm.serve.config import ModelEntry, ServerConfig

BUILD_APP = "rayllm.serve.builder:build_app"


def server_configs(path: str) -> list[ServerConfig]:
    """The ServerConfig of each application of a Serve config file that this package builds."""
    with open(path) as f:
        doc: dict[str, Any] = yaml.safe_load(f) or {}
    return [ServerConfig.from_args(app.get("args") or {}) for app in doc.get("applications") or []
            if app.get("import_path") == BUILD_APP]


def prewarm_model(entry: ModelEntry, out: TextIO, tokenizer_only: bool = False) -> None:
    """One model's caches: its tokenizer snapshot, and on CPU (one rank) its weight cache entry and kernels."""
    from rayllm.engine.client.engine_client import make_engine_client
    from rayllm.loader import weight_cache
    from rayllm.platforms.cpu import kernels as cpu_kernels
    from rayllm.serve.tokenizer import TokenizerService

    name = entry.engine.model.served_model_name or entry.name
    source, revision = entry.engine.model.model, entry.engine.model.revision
    if model_sources.is_remote(source):
        print(f"rayllm prewarm: {name}: skipped (remote source {source}: its replicas fetch it)", file=out)
        return
    t = time.perf_counter()
    local = resolve_model_path(source, revision)
    TokenizerService(local)
    print(f"rayllm prewarm: {name}: tokenizer {time.perf_counter() - t:.1f} s", file=out, flush=True)
    parallel = entry.engine.parallel
    if tokenizer_only or parallel.device != "cpu":
        return
    t = time.perf_counter()
    if parallel.tensor_parallel_size == 1 and weight_cache.applies(entry.engine, local):
        make_engine_client(entry.engine, own_process=False).shutdown()  # writes the entry, builds the kernels
        print(f"rayllm prewarm: {name}: weights and kernels {time.perf_counter() - t:.1f} s", file=out, flush=True)
    else:  # no cache entry to write here (a shard, safetensors, quantized weights): the kernels only
        cpu_kernels.build()
        print(f"rayllm prewarm: {name}: kernels {time.perf_counter() - t:.1f} s", file=out, flush=True)


def prewarm(path: str, out: TextIO = sys.stderr, tokenizer_only: bool = False) -> int:
    """Every model of the config's applications; the number of models whose caches could not be filled."""
    failed = 0
    for config in server_configs(path):
        for entry in with_resolved_device(config).models:
            try:
                prewarm_model(entry, out, tokenizer_only)
            except Exception as e:  # noqa: BLE001 - reported; the replica builds what is missing at its start
                failed += 1
                print(f"rayllm prewarm: {entry.name}: not prewarmed ({first_line(e)}); its first start builds the caches",
                      file=out)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="cluster.yaml")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a model could not be prewarmed")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="the tokenizer snapshots only (an image build: the weight cache is keyed by the CPU)")
    args = parser.parse_args(argv)
    failed = prewarm(args.config, tokenizer_only=args.tokenizer_only)
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
