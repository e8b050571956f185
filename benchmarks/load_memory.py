"""Peak and final resident memory of one rank loading a model (no KV cache), in a fresh process.

    python benchmarks/load_memory.py [--model PATH] [--dtype bfloat16]

Prints the process's peak RSS during load (ru_maxrss), its RSS once loaded, and the parameter bytes.
The interpreter and torch alone are measured first and reported, so the load's own share is clear.
"""

from __future__ import annotations

import argparse
import resource

import torch


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from rayllm.executor.worker import Worker
    from rayllm.loader.loader import read_arch
    from rayllm.loader.model_files import default_model_path
    from rayllm.schema.config import CpuConfig, EngineConfig, ModelConfig, ParallelConfig

    path = args.model or default_model_path()
    arch = read_arch(path)
    # Prepacking copies weights into oneDNN's layout; it is off here so the number is the load itself.
    config = EngineConfig(model=ModelConfig(model=path, dtype=args.dtype),
                          parallel=ParallelConfig(device="cpu", cpu=CpuConfig(weight_prepack=False,
                                                                              small_batch_quant="none")))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worker = Worker(config, path, arch, rank=0, dist_init=None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    params = sum(p.numel() * p.element_size() for p in worker.model.parameters()) / 2**20
    print(f"model {path} dtype {args.dtype} torch {torch.__version__}")
    print(f"before load peak RSS {base:.0f} MiB; after load: peak {peak:.0f} MiB, now {rss_mib():.0f} MiB; "
          f"parameters {params:.0f} MiB")


if __name__ == "__main__":
    main()
