"""How far each CPU kernel path moves the model's output from the fp32 reference, and which layers lose most.

    python benchmarks/quant_quality.py [--prompts 576] [--new-tokens 32] [--paths ...] [--ref-cache FILE]
                                       [--parts-dir DIR]
    python benchmarks/quant_quality.py --table RESULTS.jsonl [...]   # the lines as markdown tables

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
  of 32 (cpu_qgemm), each row then its quantization residual (two int8 passes) on every 4-bit layer, and the
  tied LM head's Q8_0 weight as two 4-bit planes on the same kernel (two passes);
- int4_vnni_1pass: one int8 pass everywhere (int8_passes 1; the default before issue 35);
- int4_vnni_gateup2: two passes on gate/up only, one elsewhere (the first fix for issue 35);
- int4_vnni_one_<types>: the shipped path with one pass on the layer types named (joined by +), two elsewhere;
- int8_only_<type>: int4 with bf16 activations everywhere except <type> (qkv_proj, o_proj, gate_up_proj,
  down_proj), whose activations are int8 in one pass: which projections lose most to int8 activations;
- int4_head_bf16 / int4_vnni_head_bf16: int4 / int4_vnni with the LM head on its bf16 weights (no 8-bit copy of
  the GGUF's Q8_0 embedding, which the other paths use as steps of up to 4 rows do): what that copy costs;
- int4_head_q8: int4 with the LM head on the Q8_0 weight itself (cpu_qgemm's two 4-bit planes, two
  activation passes, as int4_vnni runs it) instead of its per-channel int8 copy (torch's int8 kernel);
- int4_vnni_head_i8: int4_vnni with the LM head on that per-channel int8 copy (the default before);
- int4_fp32acc: int4's own arithmetic done another way (the same 4-bit weights dequantized to fp32, bf16 rows
  multiplied in fp32, rounded to bf16): how identical greedy answers can be to int4's when only the
  summation order and rounding differ (the floor for any other kernel);
- quantized / quantized_vnni: `model.weights: quantized` (no dense copy), torch's int4 kernel / cpu_qgemm.

One JSON line per path: top-1 agreement with fp32, KL(fp32 || path) per token (mean, p99), the mean drop
in log probability of fp32's token, the same per prompt kind, and the share of greedy outputs identical to
int4's and to fp32's. KL is summed over fp32's 1,024 most likely tokens (`ref_mass` is their mean share).
`greedy_same_as_int4` is issue 35's free-running measure: the share of prompts whose 32 greedy tokens
(ignore_eos) equal those of 4-bit weights x bf16 activations token for token. `--table` prints the paths
and the per-layer-type rows (int8_only_<type>, the LM head's copy) as markdown, each against `int4`.

A long run splits: --ref-cache keeps fp32's and int4's outputs, and --parts-dir keeps each other path's
results per chunk of 64 prompts, so the same command run again (after a time limit cut it) goes on from
the last finished chunk. Clear the directory after changing the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

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
# int4_vnni_one_<types>: the shipped path with one int8 pass on these layer types (joined by +), two elsewhere.
ONE_PASS_MIXES = ("o_proj", "o_proj+qkv_proj", "o_proj+down_proj", "o_proj+qkv_proj+down_proj", "o_proj+gate_up_proj",
                  "o_proj+gate_up_proj+down_proj")
PATHS = {  # name -> (dtype, small_batch_quant, forced kernel, model.weights)
    "fp32": ("float32", "none", "default", "auto"),
    "int4": ("bfloat16", "weight_only", "small-batch", "auto"),
    "bf16": ("bfloat16", "none", "default", "auto"),
    "int4_vnni": ("bfloat16", "auto", "small-batch", "auto"),
    "int4_vnni_1pass": ("bfloat16", "auto", "small-batch", "auto"),
    "int4_vnni_gateup2": ("bfloat16", "auto", "small-batch", "auto"),
    **{f"int8_only_{t}": ("bfloat16", "auto", "small-batch", "auto") for t in LAYER_TYPES},
    **{f"int4_vnni_one_{m}": ("bfloat16", "auto", "small-batch", "auto") for m in ONE_PASS_MIXES},
    "int4_head_bf16": ("bfloat16", "weight_only", "small-batch", "auto"),
    "int4_vnni_head_bf16": ("bfloat16", "auto", "small-batch", "auto"),
    "int4_head_q8": ("bfloat16", "weight_only", "small-batch", "auto"),
    "int4_fp32acc": ("bfloat16", "weight_only", "small-batch", "auto"),
    "int4_vnni_head_i8": ("bfloat16", "auto", "small-batch", "auto"),
    "quantized": ("bfloat16", "none", "default", "quantized"),
    "quantized_vnni": ("bfloat16", "auto", "default", "quantized"),
}
TOP_K = 1024
CHUNK = 64  # prompts per --parts-dir checkpoint (the engines' max_num_seqs)


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


class Fp32Int4:
    """A 4-bit layer as torch's int4 kernel defines it ((q - 8) * scale + zero, scale and zero in bf16, groups
    of 32), dequantized to fp32 and multiplied in fp32."""

    def __init__(self, weight: torch.Tensor) -> None:
        n, k = weight.shape
        g = weight.float().view(n, k // 32, 32)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo).clamp(min=1e-8) / 15
        q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15)
        d, z = scale.to(torch.bfloat16).float(), (lo + 8 * scale).to(torch.bfloat16).float()
        self.w = ((q - 8) * d.unsqueeze(-1) + z.unsqueeze(-1)).view(n, k).T.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() @ self.w).to(x.dtype)


def repack(engine: LLMEngine, name: str) -> None:
    """int4_vnni_1pass, int4_vnni_gateup2 and int8_only_<type>: rebuild the 4-bit layers' packed copies (not
    the LM head's); *_head_bf16: drop the LM head's 8-bit copy; *_head_q8: the LM head on cpu_qgemm's Q8_0 planes;
    *_head_i8: the LM head on a per-channel int8 copy (torch's int8 kernel)."""
    for mod_name, module in engine.executor.worker.model.named_modules():
        method = getattr(module, "method", None)
        if not isinstance(method, SmallBatchMethod):
            continue
        if isinstance(module, parallel.ParallelLMHead):
            if name.endswith("_head_bf16"):
                module.set_method(method.large)
            elif name.endswith("_head_q8") and cpu_qgemm.available():
                method.small.vnni = cpu_qgemm.Int8VnniWeight(module.weight.data)
            elif name.endswith("_head_i8"):
                module.set_method(SmallBatchMethod(parallel.PackedWeight(
                    module.weight.data, 8, parallel.SMALL_BATCH_TOKENS_LM_HEAD), method.large))
            continue
        if name == "int4_fp32acc":
            small = Fp32Int4(module.weight.data)
            small.max_tokens = method.small.max_tokens
            module.set_method(SmallBatchMethod(small, method.large))
            continue
        if name not in ("int4_vnni_1pass", "int4_vnni_gateup2") and not name.startswith(("int8_only_", "int4_vnni_one_")):
            continue
        vnni = name.startswith("int4_vnni") or mod_name.endswith(name.removeprefix("int8_only_"))
        passes = 2 if name == "int4_vnni_gateup2" and mod_name.endswith("gate_up_proj") else 1
        if name.startswith("int4_vnni_one_"):
            passes = 1 if mod_name.endswith(tuple(name.removeprefix("int4_vnni_one_").split("+"))) else 2
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


def run_chunk(engine: LLMEngine, batch: list[list[int]], start: int, ref: dict, greedy: SamplingParams) -> dict:
    """One path's greedy outputs and teacher-forced comparison for prompts start.. of the full set."""
    outs = engine.generate(batch, greedy)
    conts = ref["ref_out"][start : start + len(batch)]
    per_prompt = score(engine, batch, conts, lambda i, lp: compare_prompt(ref["vals"], ref["idx"], ref["chosen"],
                                                                          ref["at"], start + i, lp))
    return {"outs": outs, "parts": {k: torch.cat([p[k] for p in per_prompt]) for k in per_prompt[0]}}


def run_path(name: str, path: str, batch: list[list[int]], ref: dict, greedy: SamplingParams, parts_dir: str,
             new_tokens: int) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """A compared path over the whole set, CHUNK prompts at a time; with parts_dir, finished chunks are kept
    there and not run again."""
    chunks = list(range(0, len(batch), CHUNK))
    files = {c: os.path.join(parts_dir, f"{name}-p{len(batch)}-t{new_tokens}-{c}.pt") if parts_dir else "" for c in chunks}
    done = {c: torch.load(f) for c, f in files.items() if f and os.path.exists(f)}
    todo = [c for c in chunks if c not in done]
    if todo:
        dtype, small, kernel, weights = PATHS[name]
        engine = make_engine(path, dtype, small, CHUNK, weights)
        repack(engine, name)
        use_kernel(kernel)
        try:
            for c in tqdm(todo, desc=f"{name} chunks", file=sys.stderr):
                done[c] = run_chunk(engine, batch[c : c + CHUNK], c, ref, greedy)
                if files[c]:
                    torch.save(done[c], files[c] + ".tmp")
                    os.replace(files[c] + ".tmp", files[c])  # a cut run never leaves half a chunk
        finally:
            use_kernel("default")
            engine.shutdown()
    outs = [o for c in chunks for o in done[c]["outs"]]
    keys = done[chunks[0]]["parts"]
    return outs, {k: torch.cat([done[c]["parts"][k] for c in chunks]) for k in keys}


def references(path: str, batch: list[list[int]], greedy: SamplingParams, cache: str, new_tokens: int) -> dict:
    """fp32's greedy continuations and top-K log-probabilities, and int4's greedy outputs (act_out): from cache
    when it holds this --prompts/--new-tokens, else fp32's computed here and act_out left to main()."""
    act_out = None
    if cache and os.path.exists(cache):
        got = torch.load(cache)
        if (got["prompts"], got["new_tokens"]) != (len(batch), new_tokens):
            raise SystemExit(f"{cache} is for other --prompts/--new-tokens")
        ref_out, act_out, vals, idx = got["ref_out"], got["act_out"], got["ref_vals"], got["ref_idx"].long()
    else:
        engine = make_engine(path, "float32", "none", CHUNK)
        try:
            ref_out = engine.generate(batch, greedy)
            tops = score(engine, batch, ref_out, lambda i, lp: lp.topk(TOP_K, -1))
        finally:
            engine.shutdown()
        vals, idx = torch.cat([t.values for t in tops]), torch.cat([t.indices for t in tops])
    return {"ref_out": ref_out, "act_out": act_out, "vals": vals, "idx": idx,
            "chosen": torch.cat([torch.tensor(c) for c in ref_out]),
            "at": [0, *torch.tensor([len(c) for c in ref_out]).cumsum(0).tolist()]}


LABELS = {"fp32": "fp32 (reference)", "bf16": "bf16 weights, oneDNN (small_batch_quant none)",
          "int4": "int4 x bf16 activations (weight_only)", "int4_vnni": "int4 x int8, 2 passes (auto, shipped)",
          "int4_vnni_1pass": "int4 x int8, 1 pass (int8_passes 1)", "int4_vnni_gateup2": "int4 x int8, 2 passes on gate/up",
          "int4_head_bf16": "int4, LM head on bf16 weights", "int4_vnni_head_bf16": "int4 x int8 2 passes, LM head bf16",
          "int4_head_q8": "int4, LM head on Q8_0 (VNNI)", "int4_vnni_head_i8": "int4 x int8 2 passes, LM head per-channel int8"}


def table(files: list[str]) -> str:
    """Markdown tables of result lines: the paths, then what each layer type costs (against int4)."""
    lines = {}
    for f in files:
        for raw in open(f):
            d = json.loads(raw)
            if d.get("bench") == "quant_quality" and "kl_mean" in d:
                lines[d["path"]] = d  # a later file's line replaces an earlier one's
    head = ("| {} | prompts | top-1 vs fp32 | mean KL | p99 KL | greedy = int4's (bf16 act.) | greedy = fp32's |\n"
            "| --- | --- | --- | --- | --- | --- | --- |")
    row = ("| {} | {prompts} | {top1_agree:.4f} | {kl_mean:.5f} | {kl_p99:.4f} | {greedy_same_as_int4:.3f} "
           "| {greedy_same_as_fp32:.3f} |")
    paths = [n for n in lines if not n.startswith("int8_only_") and "_head_" not in n]
    layers = [n for n in lines if n not in paths]
    out = [head.format("path"), *[row.format(LABELS.get(n, n), **lines[n]) for n in paths]]
    if layers:
        out += ["", head.format("one layer type changed (the rest as int4)"),
                *[row.format(n.removeprefix("int8_only_") + " in int8, 1 pass" if n.startswith("int8_only_")
                             else LABELS.get(n, n), **lines[n]) for n in layers]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=576, help="the first N of quality_prompts.py's set")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list; fp32 and int4 (the references) run first")
    ap.add_argument("--ref-cache", default="", help="a file keeping fp32's and int4's outputs: written by the first "
                    "run, read by later ones with the same --prompts/--new-tokens (a long run split into several)")
    ap.add_argument("--parts-dir", default="", help="keep each path's finished chunks of 64 prompts here; a rerun "
                    "goes on from them")
    ap.add_argument("--table", nargs="+", default=None, help="print these result files' lines as markdown and exit")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  f"quant-quality-{time.strftime('%Y%m%d-%H%M')}.jsonl"))
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    from transformers import AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    pairs = quality_prompts(args.prompts)
    kinds = [k for k, _ in pairs]
    batch = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True), add_special_tokens=False).input_ids
             for _, text in pairs]
    greedy = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    if args.parts_dir:
        os.makedirs(args.parts_dir, exist_ok=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    t0 = time.perf_counter()
    ref = references(path, batch, greedy, args.ref_cache, args.new_tokens)
    positions = sum(len(c) for c in ref["ref_out"])
    wanted = [p for p in args.paths.split(",") if p not in ("fp32", "int4")]
    if ref["act_out"] is None or "int4" in args.paths.split(","):  # from a cache, int4 again checks it
        wanted.insert(0, "int4")
    with open(args.out, "w") as f:
        f.write(json.dumps({"bench": "quant_quality", "path": "fp32", "prompts": len(batch), "positions": positions,
                            "ref_mass": round(float(ref["vals"].exp().sum(-1).mean()), 5),
                            "seconds": round(time.perf_counter() - t0, 1)}) + "\n")
        for name in tqdm(wanted, desc="paths", file=sys.stderr):
            if PATHS[name][1] == "auto" and not cpu_qgemm.available():
                print(f"skipping {name}: this CPU or build has no AVX-512 VNNI kernel", file=sys.stderr)
                continue
            t0 = time.perf_counter()
            outs, parts = run_path(name, path, batch, ref, greedy, args.parts_dir, args.new_tokens)
            if ref["act_out"] is None:
                ref["act_out"] = outs
                if args.ref_cache:
                    torch.save({"prompts": len(batch), "new_tokens": args.new_tokens, "ref_out": ref["ref_out"],
                                "act_out": outs, "ref_vals": ref["vals"], "ref_idx": ref["idx"].int()}, args.ref_cache)
            by_kind = {}
            kind_of_pos = [k for k, c in zip(kinds, ref["ref_out"], strict=True) for _ in c]
            for kind in dict.fromkeys(kinds):
                mask = torch.tensor([k == kind for k in kind_of_pos])
                by_kind[kind] = summary({k: v[mask] for k, v in parts.items()})
            line = {
                "bench": "quant_quality", "path": name, "prompts": len(batch), "positions": positions,
                "new_tokens": args.new_tokens, **summary(parts),
                "greedy_same_as_int4": round(sum(a == b for a, b in zip(outs, ref["act_out"], strict=True)) / len(batch), 4),
                "greedy_same_as_fp32": round(sum(a == b for a, b in zip(outs, ref["ref_out"], strict=True)) / len(batch), 4),
                "by_kind": by_kind, "seconds": round(time.perf_counter() - t0, 1),
            }
            print(json.dumps({k: v for k, v in line.items() if k != "by_kind"}), flush=True)
            f.write(json.dumps(line) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
