"""Batch invariance: a greedy sequence's logits, bit for bit, whatever shares its steps.

One target prompt runs alone, then inside batches of 2, 8 and 24 mixed prompts (arriving together and
staggered, so its decode rows share steps with other prompts' prefill chunks), with its prefix from
the cache, with its prefill chunked, and beside sequences decoding with LoRA adapters (one adapter,
or a mix of two adapters and the base model). The same target under an adapter runs alone and beside
base requests, its own adapter and the mix. Its logits at
every generated position are compared with the solo run's with `torch.equal`.

The model is the default GGUF cut to its first two decoder layers (tests/gpu/trim_gguf.py: its real
Q4_1/Q8_0 weights byte for byte, its shapes, vocabulary and LM head): every kernel a layer runs is the
full model's, at a fifteenth of its depth. Not `tiny_llama`: its dense fp32 weights get no int4 copies,
and without the switch its logits varied only beside adapters (none of the base-model scenarios), so
there the check could not tell whether the switch does its work.
The engine runs the shipped settings (cluster.yaml: bf16, int4 small-batch copies of the GGUF's Q4
weights, oneDNN prepacking, prefix caching, C attention kernels, 1 thread per rank and 2 for a
sequence alone, LoRA slots) plus `scheduler.batch_invariant`. `test_default_mode_varies` shows what
the switch is for: without it the same comparison fails on the same model."""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.layers.linear_method import LinearBase, SmallBatchMethod
from rayllm.lora.files import random_peft_adapter
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams
from tests.gpu.trim_gguf import trim

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

NEW_TOKENS = 8
LAYERS = 2  # decoder layers kept of the default model's 30: the same kernels on every layer
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def make_engine(path: str, batch_invariant: bool, weights: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype="bfloat16", weights=weights),
        cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=1024,
                                  batch_invariant=batch_invariant),
        parallel=ParallelConfig(device="cpu", cpu=CpuConfig(threads_per_rank=1, threads_single_sequence=2)),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
    ))


class LogitRecorder:
    """Keeps each request's sampled-row logits per step, from the model's own LM head output."""

    def __init__(self, engine: LLMEngine):
        worker = engine.executor.worker
        runner, model = worker.runner, worker.model
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)
        captured: list[torch.Tensor] = []
        run_step, lm_head = runner.execute, model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            out = lm_head(hidden)
            captured.append(out.clone())
            return out

        def execute(step):
            captured.clear()
            result = run_step(step)
            sampling = [s.request_id for s in step.seqs if s.sample]  # no prompt logprobs: rows in this order
            for i, rid in enumerate(sampling):
                self.rows[rid].append(captured[-1][i])
            return result

        runner.execute, model.compute_logits = execute, compute_logits


def run(engine: LLMEngine, recorder: LogitRecorder, target: list[int], others: list[list[int]], tag: str, *,
        stagger: int = 0, warm_prefix: bool = False, lora_id: int | list[int] = 0, target_lora: int = 0) -> torch.Tensor:
    """The target's logits [NEW_TOKENS, vocab] (under adapter `target_lora`, 0 = base) with `others` in
    the batch; others join after `stagger` steps (so the target's decode steps carry their prefill),
    other i under adapter `lora_id` (or `lora_id[i % len]` for a mix of adapters and base)."""
    engine.reset_prefix_cache()
    if warm_prefix:  # the target's prompt blocks are cached by an earlier request
        engine.add_request(f"{tag}-warm", target, SamplingParams(temperature=0, max_tokens=1), lora_slot=target_lora)
        while engine.has_work():
            engine.step()
    rid = f"{tag}-target"
    engine.add_request(rid, target, GREEDY, lora_slot=target_lora)
    for _ in range(stagger):
        engine.step()
    ids = lora_id if isinstance(lora_id, list) else [lora_id]
    for i, p in enumerate(others):
        engine.add_request(f"{tag}-{i}", p, GREEDY, lora_slot=ids[i % len(ids)])
    while engine.has_work():
        engine.step()
    return torch.stack(recorder.rows.pop(rid))


def mismatch(ref: torch.Tensor, got: torch.Tensor) -> str | None:
    if torch.equal(ref, got):
        return None
    step = int((ref != got).any(-1).nonzero()[0])
    return f"first differs at token {step}, max |diff| {float((ref.float() - got.float()).abs().max()):.3g}"


@pytest.fixture(scope="module")
def prompts(hf_tokenizer, chat_prompts) -> tuple[list[int], list[list[int]]]:
    """A ~200-token target (long enough to be chunked) and 24 others of mixed lengths."""
    text = "Summarise this: " + " ".join(f"item {i} is {'red' if i % 3 else 'blue'};" for i in range(40))
    msgs = [{"role": "user", "content": text}]
    target = hf_tokenizer(hf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False).input_ids
    others = [p + p[-(i % 5) * 7 - 1 :] for i, p in enumerate(chat_prompts * 3)][:24]
    return target, others


@pytest.fixture(scope="module")
def model_path(gguf_path, tmp_path_factory) -> str:
    """The default GGUF's first LAYERS decoder layers (real weights, metadata and tokenizer unchanged)."""
    path = str(tmp_path_factory.mktemp("trimmed") / f"smollm2-{LAYERS}layers.gguf")
    trim(gguf_path, path, LAYERS)
    return path


# Neighbours that mix two adapters and the base model (the grouped LoRA path, padding rows included).
MIX = [7, 9, 0]


def load_adapters(engine: LLMEngine, tmp_path) -> None:
    arch = engine.executor.worker.arch
    for slot, (lora_id, rank) in enumerate([(7, 8), (9, 4)], start=1):  # ranks differ: 9's is padded in a mix
        path = random_peft_adapter(str(tmp_path / f"adapter{lora_id}"), arch, rank, seed=lora_id)
        engine.executor.load_lora(slot, lora_id, path)


def compare(engine: LLMEngine, rec: LogitRecorder, refs: dict[int, torch.Tensor], target: list[int],
            cases: dict[str, dict], bad: dict[str, str], only: frozenset[str] | None, ran: set[str]) -> None:
    for name, kw in cases.items():
        if only is not None and name not in only:
            continue
        ran.add(name)
        ref = refs[kw.get("target_lora", 0)]
        if (m := mismatch(ref, run(engine, rec, target, tag=name, **kw))) is not None:
            bad[name] = m


def kernels(engine: LLMEngine) -> Counter[str]:
    """How many linear layers run each kind of weight method: "int4 x int8 every step" for a small-batch
    VNNI copy that serves every step size, else the method's class name (with its large-batch path's)."""
    counts: Counter[str] = Counter()
    for module in engine.executor.worker.model.modules():
        if isinstance(module, LinearBase):
            method = module.method
            if isinstance(method, SmallBatchMethod):
                kind = ("int4 x int8 every step" if method.every_step and method.small.vnni is not None
                        else f"small batch, then {type(method.large).__name__}")
            else:
                kind = type(method).__name__
            counts[kind] += 1
    return counts


def scenarios(path: str, batch_invariant: bool, prompts, tmp_path, weights: str = "auto",
              only: frozenset[str] | None = None, methods: Counter[str] | None = None) -> dict[str, str]:
    """Mismatches against the solo run (of the base model, or of adapter 7 for the `adapter-` cases), by
    scenario (an empty dict: all bit-equal); `only`: just these scenarios; `methods`: filled with the
    engine's kernels()."""
    target, others = prompts
    engine = make_engine(path, batch_invariant, weights=weights)
    if methods is not None:
        methods.update(kernels(engine))
    bad: dict[str, str] = {}
    ran: set[str] = set()
    try:
        rec = LogitRecorder(engine)
        load_adapters(engine, tmp_path)
        refs = {0: run(engine, rec, target, [], "solo"), 7: run(engine, rec, target, [], "solo-7", target_lora=7)}
        assert not torch.equal(refs[0], refs[7])  # the adapter does change the target's logits
        compare(engine, rec, refs, target, {
            "batch2": dict(others=others[:1]),
            "batch8": dict(others=others[:7]),
            "batch24": dict(others=others),
            "batch24-staggered": dict(others=others, stagger=2),
            "prefix-cached": dict(others=[], warm_prefix=True),
            "prefix-cached-batch8": dict(others=others[:7], warm_prefix=True),
            # (1) a base request beside adapter requests
            "lora-neighbours": dict(others=others[:7], lora_id=7),
            "mixed-lora-neighbours": dict(others=others[:8], lora_id=MIX),
            "mixed-lora-neighbours-24-staggered": dict(others=others, lora_id=MIX, stagger=2),
            # (2) an adapter request beside base requests, its own adapter, and a mix
            "adapter-base-neighbours": dict(others=others[:7], target_lora=7),
            "adapter-same-neighbours": dict(others=others[:7], lora_id=7, target_lora=7),
            "adapter-mixed-neighbours": dict(others=others[:8], lora_id=MIX, target_lora=7),
            "adapter-mixed-24-staggered": dict(others=others, lora_id=MIX, stagger=2, target_lora=7),
            "adapter-prefix-cached-mixed": dict(others=others[:8], lora_id=MIX, warm_prefix=True, target_lora=7),
        }, bad, only, ran)
        chunked_cases = {
            "chunked": dict(others=[]),
            "chunked-batch8": dict(others=others[:7], stagger=1),
            "adapter-chunked-mixed": dict(others=others[:8], lora_id=MIX, stagger=1, target_lora=7),
        }
        if only is None or only & chunked_cases.keys():
            # The same engine with a 64-token step budget (~200 tokens: 4 chunks): the budget is read by the
            # scheduler at each step and sizes nothing the worker holds, so this is the engine a
            # `max_num_batched_tokens: 64` config builds, without loading the model again.
            rebudget(engine, 64)
            compare(engine, rec, refs, target, chunked_cases, bad, only, ran)
    finally:
        engine.shutdown()
    assert only is None or only <= ran, f"no such scenarios: {sorted(only - ran)}"
    return bad


def rebudget(engine: LLMEngine, tokens: int) -> None:
    sched = dataclasses.replace(engine.config.scheduler, max_num_batched_tokens=tokens)
    engine.config = dataclasses.replace(engine.config, scheduler=sched)
    engine.scheduler.config = sched


def test_batch_invariant_mode(model_path, prompts, tmp_path):
    """With the switch, every 4-bit layer runs its int4 x int8 VNNI copy at every step size (each row alone,
    exact integer sums) and the rest oneDNN's batch-invariant layout; the LM head (Q8_0) runs the same kernel
    as two 4-bit planes."""
    methods: Counter[str] = Counter()
    assert scenarios(model_path, True, prompts, tmp_path, methods=methods) == {}
    # Two decoder layers of 4 projections each, and the LM head: all on the VNNI kernel, none switching.
    assert methods == {"int4 x int8 every step": 4 * LAYERS + 1}, methods


def test_default_mode_varies(model_path, prompts, tmp_path):
    """Without the switch, a sequence's numerics follow the load (int4 copies for steps of <= 8 tokens,
    oneDNN blocking past 32 rows): the check above would catch it. Only the two batches it names run."""
    bad = scenarios(model_path, False, prompts, tmp_path, only=frozenset({"batch8", "batch24"}))
    assert "batch24" in bad and "batch8" in bad, bad


# What the weights' kernel can change: the row count (2, 8, 24), prefill chunks beside decode rows, a prefix
# read from the cache, a chunked prompt, and adapter deltas of a mix on top of the base GEMM. The other
# scenarios vary only what test_batch_invariant_mode already covers (LoRA grouping, the target's adapter).
KERNEL_SCENARIOS = frozenset({"batch2", "batch8", "batch24", "batch24-staggered", "prefix-cached-batch8",
                              "mixed-lora-neighbours", "adapter-mixed-neighbours", "chunked-batch8"})


def test_batch_invariant_quantized_weights(model_path, prompts, tmp_path):
    """`model.weights: quantized`: the int4 kernel serves every step size and its rows do not depend on
    the row count, so with the switch (for the dense LM head) this mode is batch-invariant too."""
    assert scenarios(model_path, True, prompts, tmp_path, weights="quantized", only=KERNEL_SCENARIOS) == {}
