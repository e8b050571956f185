"""How far each CPU kernel path moves the model's output from the fp32 reference, and which layers lose most.

    python benchmarks/quant_quality.py [--prompts 576] [--new-tokens 32] [--paths ...] [--ref-cache FILE]

Prompts: quality_prompts.py's fixed set (chat questions, explanations, code, lists, numbers, other
languages, translation, writing), chat-templated. fp32 (no quantized kernels) writes a greedy continuation
of each; each path then scores prompt + continuation teacher-forced (every position sees the same
context) and its next-token distribution is compared with fp32's at every continuation position. Free
running: each path's own greedy continuations (all prompts batched; decode steps run on its kernels)
against those of `int4` (the same 4-bit weights with bf16 activations) and of fp32.

Paths (the int4 ones are forced onto their kernel for every position, as decode steps run them):
- bf16: bf16 weights, oneDNN's GEMM (steps above the small-batch sizes);
- int4: the GGUF's Q4 weights x bf16 activations (torch's int4 kernel; small_batch_quant weight_only);
- int4_vnni: the shipped default (small_batch_quant auto, int8_passes 2): int4 x int8 activations in groups
  of 32 (cpu_qgemm), each row then its quantization residual (two int8 passes) on every 4-bit layer;
- int4_vnni_1pass: one int8 pass everywhere (int8_passes 1; the default before issue 35);
- int4_vnni_gateup2: two passes on gate/up only, one elsewhere (the first fix for issue 35);
- int8_only_<type>: int4 with bf16 activations everywhere except <type> (qkv_proj, o_proj, gate_up_proj,
  down_proj), whose activations are int8 in one pass: which projections lose most to int8 activations;
- quantized / quantized_vnni: `model.weights: quantized` (no dense copy), torch's int4 kernel / cpu_qgemm.

One JSON line per path: top-1 agreement with fp32, KL(fp32 || path) per token (mean, p99), the mean drop
in log probability of fp32's token, the same per prompt kind, and the share of greedy outputs identical to
int4's and to fp32's. KL is summed over fp32's 1,024 most likely tokens (`ref_mass` is their mean share).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from quality_prompts import quality_prompts  # noqa: E402

import rayllm.layers.linear as parallel  # noqa: E402
from rayllm.engine.engine import LLMEngine  # noqa: E402
from rayllm.layers.linear_method import SmallBatchMethod  # noqa: E402
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

LAYER_TYPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
PATHS = {  # name -> (dtype, small_batch_quant, forced kernel, model.weights)
    "fp32": ("float32", "none", "default", "auto"),
    "int4": ("bfloat16", "weight_only", "small-batch", "auto"),
    "bf16": ("bfloat16", "none", "default", "auto"),
    "int4_vnni": ("bfloat16", "auto", "small-batch", "auto"),
    "int4_vnni_1pass": ("bfloat16", "auto", "small-batch", "auto"),
    "int4_vnni_gateup2": ("bfloat16", "auto", "small-batch", "auto"),
    **{f"int8_only_{t}": ("bfloat16", "auto", "small-batch", "auto") for t in LAYER_TYPES},
    "quantized": ("bfloat16", "none", "default", "quantized"),
    "quantized_vnni": ("bfloat16", "auto", "default", "quantized"),
}
TOP_K = 1024


_APPLY = SmallBatchMethod.apply


def use_kernel(kind: str) -> None:
    """Route the small-batch (GGUF-quantized) layers' matmuls: the engine's own choice, or their packed copy at
    every step size."""
    if kind == "default":
        SmallBatchMethod.apply = _APPLY  # type: ignore[method-assign]
        return

    def forced(self: SmallBatchMethod, layer, x):
        out = self.small(x)
        return out if layer.bias is None else out + layer.bias

    SmallBatchMethod.apply = forced  # type: ignore[method-assign]


def repack(engine: LLMEngine, name: str) -> None:
    """int4_vnni_1pass, int4_vnni_gateup2 and int8_only_<type>: rebuild the 4-bit layers' packed copies (not
    the LM head's)."""
    if name not in ("int4_vnni_1pass", "int4_vnni_gateup2") and not name.startswith("int8_only_"):
        return
    for mod_name, module in engine.executor.worker.model.named_modules():
        method = getattr(module, "method", None)
        if not isinstance(method, SmallBatchMethod) or isinstance(module, parallel.ParallelLMHead):
            continue
        vnni = name.startswith("int4_vnni") or mod_name.endswith(name.removeprefix("int8_only_"))
        passes = 2 if name == "int4_vnni_gateup2" and mod_name.endswith("gate_up_proj") else 1
        module.set_method(SmallBatchMethod(parallel.PackedWeight(module.weight.data, 4, vnni=vnni, passes=passes),
                                           method.large))


def make_engine(path: str, dtype: str, small: str, max_seqs: int, weights: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype=dtype, weights=weights),
        cache=CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=2048),
        parallel=ParallelConfig(cpu=CpuConfig(threads_per_rank=0, small_batch_quant=small)),
    ))


def score(engine: LLMEngine, batch: list[list[int]], conts: list[list[int]], reduce) -> list:
    """Per prompt i, reduce(i, log-probabilities [len(cont), vocab] of each continuation position), teacher-forced
    (one prompt's at a time: all of 576 prompts' full log-probabilities would take GBs)."""
    out = []
    for i, (p, cont) in enumerate(zip(batch, conts, strict=True)):
        logits = engine.executor.score(p + cont)
        # position t predicts token t + 1: the continuation's predictions start at len(p) - 1
        out.append(reduce(i, torch.log_softmax(logits[len(p) - 1 : -1].float(), -1)))
    return out


def compare(ref_vals: torch.Tensor, ref_idx: torch.Tensor, got: torch.Tensor, chosen: torch.Tensor) -> dict:
    """ref_vals/ref_idx: fp32's top-K log-probs per position; got: the path's full log-probs."""
    kl = (ref_vals.exp() * (ref_vals - got.gather(1, ref_idx))).sum(-1)
    return {"top1": (got.argmax(-1) == ref_idx[:, 0]).float(), "kl": kl,
            "drop": ref_vals[:, 0] - got.gather(1, chosen.unsqueeze(1)).squeeze(1)}


def compare_prompt(ref_vals: torch.Tensor, ref_idx: torch.Tensor, chosen: torch.Tensor, at: list[int], i: int,
                   got: torch.Tensor) -> dict:
    """compare() on prompt i's positions (at: where each prompt's positions start)."""
    return compare(ref_vals[at[i] : at[i + 1]], ref_idx[at[i] : at[i + 1]], got, chosen[at[i] : at[i + 1]])


def summary(parts: dict[str, torch.Tensor]) -> dict:
    return {"top1_agree": round(float(parts["top1"].mean()), 4), "kl_mean": round(float(parts["kl"].mean()), 5),
            "kl_p99": round(float(parts["kl"].quantile(0.99)), 4),
            "logp_drop_mean": round(float(parts["drop"].mean()), 5)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=576, help="the first N of quality_prompts.py's set")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list; fp32 and int4 (the references) run first")
    ap.add_argument("--ref-cache", default="", help="a file keeping fp32's and int4's outputs: written by the first "
                    "run, read by later ones with the same --prompts/--new-tokens (a long run split into several)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  f"quant-quality-{time.strftime('%Y%m%d-%H%M')}.jsonl"))
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    pairs = quality_prompts(args.prompts)
    kinds = [k for k, _ in pairs]
    batch = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True), add_special_tokens=False).input_ids
             for _, text in pairs]
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ref_vals = ref_idx = chosen = None
    ref_out: list[list[int]] = []
    act_out: list[list[int]] = []
    wanted = [p for p in args.paths.split(",") if p not in ("fp32", "int4")]
    order = ["fp32", "int4", *wanted]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    cached = None
    if args.ref_cache and os.path.exists(args.ref_cache):
        cached = torch.load(args.ref_cache)
        if (cached["prompts"], cached["new_tokens"]) != (len(batch), args.new_tokens):
            raise SystemExit(f"{args.ref_cache} is for other --prompts/--new-tokens")
        ref_out, act_out, ref_vals, ref_idx = cached["ref_out"], cached["act_out"], cached["ref_vals"], cached["ref_idx"].long()
        chosen = torch.cat([torch.tensor(c) for c in ref_out])
        order = wanted
    with open(args.out, "w") as f:
        for name in tqdm(order, desc="paths", file=sys.stderr):
            dtype, small, kernel, weights = PATHS[name]
            if small == "auto" and dtype == "bfloat16" and not cpu_qgemm.available():
                print(f"skipping {name}: this CPU or build has no AVX-512 VNNI kernel", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            engine = make_engine(path, dtype, small, min(64, len(batch)), weights)
            repack(engine, name)
            use_kernel(kernel)
            try:
                outs = engine.generate(batch, greedy)
                if name == "fp32":
                    ref_out = outs
                    tops = score(engine, batch, ref_out, lambda i, lp: lp.topk(TOP_K, -1))
                else:
                    at = [0, *torch.tensor([len(c) for c in ref_out]).cumsum(0).tolist()]
                    per_prompt = score(engine, batch, ref_out, partial(compare_prompt, ref_vals, ref_idx, chosen, at))
            finally:
                use_kernel("default")
                engine.shutdown()
            positions = sum(len(c) for c in ref_out)
            if name == "fp32":
                ref_vals, ref_idx = torch.cat([t.values for t in tops]), torch.cat([t.indices for t in tops])
                chosen = torch.cat([torch.tensor(c) for c in ref_out])
                f.write(json.dumps({"bench": "quant_quality", "path": "fp32", "prompts": len(batch),
                                    "positions": positions,
                                    "ref_mass": round(float(ref_vals.exp().sum(-1).mean()), 5)}) + "\n")
                continue
            if name == "int4":
                act_out = outs
                if args.ref_cache:
                    torch.save({"prompts": len(batch), "new_tokens": args.new_tokens, "ref_out": ref_out, "act_out": outs,
                                "ref_vals": ref_vals, "ref_idx": ref_idx.int()}, args.ref_cache)
            assert ref_vals is not None and ref_idx is not None and chosen is not None
            parts = {k: torch.cat([p[k] for p in per_prompt]) for k in per_prompt[0]}
            by_kind = {}
            kind_of_pos = [k for k, c in zip(kinds, ref_out, strict=True) for _ in c]
            for kind in dict.fromkeys(kinds):
                mask = torch.tensor([k == kind for k in kind_of_pos])
                by_kind[kind] = summary({k: v[mask] for k, v in parts.items()})
            line = {
                "bench": "quant_quality", "path": name, "prompts": len(batch), "positions": positions,
                "new_tokens": args.new_tokens, **summary(parts),
                "greedy_same_as_int4": round(sum(a == b for a, b in zip(outs, act_out, strict=True)) / len(batch), 4),
                "greedy_same_as_fp32": round(sum(a == b for a, b in zip(outs, ref_out, strict=True)) / len(batch), 4),
                "by_kind": by_kind, "seconds": round(time.perf_counter() - t0, 1),
            }
            print(json.dumps({k: v for k, v in line.items() if k != "by_kind"}), flush=True)
            f.write(json.dumps(line) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
