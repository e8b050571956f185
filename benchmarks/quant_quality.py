"""How far each CPU kernel path moves the model's output from the fp32 reference.

    python benchmarks/quant_quality.py [--prompts 16] [--new-tokens 64]

The fp32 engine (no quantized kernels) writes a greedy continuation of each chat prompt. Each path
then scores prompt + continuation teacher-forced (so every position sees the same context), and its
next-token distribution is compared with fp32's at every continuation position:

- bf16: the bf16 weights with oneDNN's GEMM (what steps above 8 tokens use);
- int4: the GGUF's own Q4 weights (weight-only int4, bf16 activations: torch's kernel), what steps of
  <= 8 tokens use where the CPU has no AVX-512 VNNI (forced here for every position);
- int4_vnni: the same weights x activations quantized to int8 in groups of 32 (cpu_qgemm), what steps
  of up to parallel.VNNI_TOKENS tokens use on CPUs with AVX-512 VNNI (forced for every position);
- quantized: `model.weights: quantized`, the GGUF's blocks kept quantized with no dense copy (torch's
  int4 kernel at every step size); quantized_vnni: the same with its 4-bit layers on cpu_qgemm;
- w8a8: a candidate measured and rejected, defined here only: per-channel int8 weights x per-token
  int8 activations (`torch._int_mm`), faster than bf16 GEMMs at 16-64 tokens but too coarse (docs/benchmarks.md).

Per path, one JSON line: top-1 agreement with fp32, mean KL(fp32 || path), the mean drop in log
probability of fp32's chosen token, and end to end: greedy generation of all prompts together
(decode steps then run on that path's kernels) compared with fp32's greedy output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_bench import prompts  # noqa: E402

import rayllm.layers.linear as parallel  # noqa: E402
from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.loader.model_files import default_model_path  # noqa: E402
from rayllm.platforms.cpu import qgemm as cpu_qgemm  # noqa: E402
from rayllm.schema.config import (  # noqa: E402
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams  # noqa: E402

PATHS = {  # name -> (dtype, small_batch_quant, which kernel every linear layer runs, model.weights)
    "fp32": ("float32", "none", "default", "auto"),
    "bf16": ("bfloat16", "none", "default", "auto"),
    "int4": ("bfloat16", "weight_only", "small-batch", "auto"),
    "int4_vnni": ("bfloat16", "auto", "small-batch", "auto"),
    "quantized": ("bfloat16", "none", "default", "quantized"),
    "quantized_vnni": ("bfloat16", "auto", "default", "quantized"),
    "w8a8": ("bfloat16", "weight_only", "w8a8", "auto"),
}


class W8A8:
    """The rejected candidate: int8 weights per output channel x int8 activations per token."""

    def __init__(self, weight: torch.Tensor):
        w = weight.float()
        self.scale = w.abs().amax(1).clamp(min=1e-8) / 127
        self.qweight_t = (w / self.scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8).t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x_scale = xf.abs().amax(-1, keepdim=True).clamp_(min=1e-8).div_(127)
        acc = torch._int_mm(torch.div(xf, x_scale).round_().to(torch.int8), self.qweight_t)
        return torch.mul(acc, x_scale).mul_(self.scale).to(x.dtype)


def use_kernel(kind: str) -> None:
    """Route the packed (GGUF-quantized) layers' matmuls: the engine's own choice, or one kernel for all."""
    original = parallel.__dict__.setdefault("_original_linear", parallel.linear)
    if kind == "default":
        parallel.linear = original
        return
    cache: dict[int, W8A8] = {}

    def forced(x, weight, bias, packed, onednn=None):
        if packed is None:
            return original(x, weight, bias, packed, onednn)
        if kind == "small-batch":
            out = packed(x)
        else:
            w8a8 = cache.get(id(weight)) or cache.setdefault(id(weight), W8A8(weight))
            out = w8a8(x)
        return out if bias is None else out + bias

    parallel.linear = forced  # the layers look `linear` up in their module at call time


def make_engine(path: str, dtype: str, small: str, max_seqs: int, weights: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype=dtype, weights=weights),
        cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
        parallel=ParallelConfig(cpu=CpuConfig(threads_per_rank=0, small_batch_quant=small)),
    ))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list; fp32 (the reference) always runs first")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "quant-latest.jsonl"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    batch = prompts(tokenizer, args.prompts)
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ref_logp: list[torch.Tensor] = []
    ref_out: list[list[int]] = []
    lines = []
    chosen = ["fp32"] + [p for p in args.paths.split(",") if p != "fp32"]
    for name in tqdm(chosen, desc="paths", file=sys.stderr):
        dtype, small, kernel, weights = PATHS[name]
        if name.endswith("_vnni") and not cpu_qgemm.available():
            print(f"skipping {name}: this CPU or build has no AVX-512 VNNI kernel", file=sys.stderr)
            continue
        engine = make_engine(path, dtype, small, args.prompts, weights)
        use_kernel(kernel)
        try:
            outs = engine.generate(batch, greedy)  # end to end: decode steps of len(batch) tokens
            if name == "fp32":
                ref_out = outs
            logps = []
            for p, cont in zip(batch, ref_out, strict=True):
                logits = engine.executor.score(p + cont)
                # position t predicts token t + 1: the continuation's predictions start at len(p) - 1
                logps.append(torch.log_softmax(logits[len(p) - 1 : -1].float(), -1))
                if name == "fp32":
                    ref_logp.append(logps[-1])
        finally:
            use_kernel("default")
        engine.shutdown()
        ref = torch.cat(ref_logp)
        got = torch.cat(logps)
        chosen = torch.cat([torch.tensor(c) for c in ref_out]).unsqueeze(1)
        line = {
            "bench": "quant_quality", "path": name, "positions": int(ref.shape[0]),
            "top1_agree": round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
            "kl_mean": round(float((ref.exp() * (ref - got)).sum(-1).mean()), 5),
            "logp_drop_mean": round(float((ref.gather(1, chosen) - got.gather(1, chosen)).mean()), 5),
            "greedy_identical": sum(a == b for a, b in zip(outs, ref_out, strict=True)),
            "greedy_prompts": len(batch),
            "greedy_common_prefix_mean": round(sum(map(common_prefix, outs, ref_out)) / len(batch), 1),
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
