"""The bf16, int4 and int4 x int8 CPU kernel paths on the real model stay close to the fp32 reference.

Teacher-forced on fp32's own greedy continuations of the chat prompts: each path's next-token
choice is compared with fp32's at every position (benchmarks/quant_quality.py measures the same
at larger scale and reports KL as well).
"""

from __future__ import annotations

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.layers import linear as parallel
from rayllm.layers.linear_method import SmallBatchMethod
from rayllm.platforms.cpu import qgemm as cpu_qgemm
from rayllm.quant.methods import Int4GroupWeight
from rayllm.schema.config import (
    CacheConfig,
    CpuConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

NEW_TOKENS = 32


def make_engine(gguf_path: str, dtype: str, weights: str = "auto", small_batch_quant: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=gguf_path, dtype=dtype, weights=weights),
        cache=CacheConfig(kv_cache_bytes=128 << 20, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        parallel=ParallelConfig(device="cpu", cpu=CpuConfig(small_batch_quant=small_batch_quant)),
    ))


@pytest.fixture(scope="module")
def reference(gguf_path, chat_prompts):
    """fp32: greedy continuations and their teacher-forced next-token argmax at each position."""
    engine = make_engine(gguf_path, "float32")
    try:
        outs = engine.generate(chat_prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        tops = [engine.executor.score(p + o)[len(p) - 1 : -1].argmax(-1) for p, o in zip(chat_prompts, outs, strict=True)]
    finally:
        engine.shutdown()
    return outs, tops


def agreement(engine: LLMEngine, prompts, reference) -> float:
    outs, tops = reference
    got = [engine.executor.score(p + o)[len(p) - 1 : -1].argmax(-1) for p, o in zip(prompts, outs, strict=True)]
    return float((torch.cat(got) == torch.cat(tops)).float().mean())


PATHS = {  # name -> (model.weights, small_batch_quant)
    "bf16": ("auto", "none"),  # oneDNN's bf16 GEMM: what steps above the small-batch sizes run
    "int4": ("auto", "weight_only"),  # the GGUF's Q4 weights x bf16 activations (torch's int4 kernel)
    "int4_vnni": ("auto", "auto"),  # the same weights x int8 activations (cpu_qgemm, AVX-512 VNNI)
    "quantized": ("quantized", "none"),  # the GGUF's blocks kept as they are (no dense linear weights)
    "quantized_vnni": ("quantized", "auto"),  # ...with their 4-bit layers on cpu_qgemm's kernel
}


@pytest.fixture(scope="module")
def shipped(gguf_path):
    """The shipped bf16 setting (weights auto, small_batch_quant auto): the int4_vnni path below and the
    README example run on this one engine (the path's test puts back what it changes)."""
    engine = make_engine(gguf_path, "bfloat16")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("path", list(PATHS))
def test_cpu_kernel_paths_agree_with_fp32(gguf_path, chat_prompts, reference, path, request):
    if path.endswith("_vnni") and not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    weights, small = PATHS[path]
    own = (weights, small) != ("auto", "auto")
    engine = make_engine(gguf_path, "bfloat16", weights, small) if own else request.getfixturevalue("shipped")
    changed: list = []
    try:
        layers = [m.method.small for m in engine.executor.worker.model.modules()
                  if isinstance(getattr(m, "method", None), SmallBatchMethod)]
        if path.startswith("int4"):
            # Whole prompts through the small-batch kernels, the LM head's copy (steps of up to
            # SMALL_BATCH_TOKENS_LM_HEAD tokens run it) included: on int4_vnni the Q8_0 weight as two 4-bit
            # planes, on int4 the per-channel int8 copy.
            body = [p for p in layers if p.max_tokens != parallel.SMALL_BATCH_TOKENS_LM_HEAD]
            heads = [p for p in layers if p.max_tokens == parallel.SMALL_BATCH_TOKENS_LM_HEAD]
            assert body and all((p.vnni is not None) == (path == "int4_vnni") for p in body)
            assert len(heads) == 1 and isinstance(heads[0].vnni, cpu_qgemm.Int8VnniWeight) == (path == "int4_vnni")
            for p in body + heads:
                changed.append((p, p.max_tokens))
                p.max_tokens = 1 << 30
        else:
            assert not layers
            kept = [m.method for m in engine.executor.worker.model.modules()
                    if isinstance(getattr(m, "method", None), Int4GroupWeight)]
            assert bool(kept) == (weights == "quantized")
            assert all((p.vnni is not None) == path.endswith("_vnni") for p in kept)
        agree = agreement(engine, chat_prompts, reference)
    finally:
        for p, max_tokens in changed:
            p.max_tokens = max_tokens
        if own:
            engine.shutdown()
    # Measured (benchmarks/quant_quality.py, 1,024 positions): bf16 0.97, int4 0.97, int4_vnni 0.96;
    # the rejected per-token W8A8 candidate 0.88. A broken kernel gives ~0.
    assert agree >= 0.93, f"{path}: top-1 agreement with fp32 {agree:.3f}"


def test_shipped_kernels_answer_the_readme_example(hf_tokenizer, request):
    """The README's chat example at temperature 0 on the shipped setting (small_batch_quant auto, the
    int4 x int8 kernel with two int8 passes on every 4-bit layer). With one pass everywhere it answered
    "L'Étoile, la Marseillaise, ..." (issue 35)."""
    if not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    tok = hf_tokenizer  # transformers' tokenizer of the default model's GGUF
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    engine = request.getfixturevalue("shipped")
    body = [m.method.small for n, m in engine.executor.worker.model.named_modules() if n.endswith("_proj")]
    assert body and all(p.vnni is not None and p.vnni.passes == 2 for p in body)
    out = engine.generate([tok(text, add_special_tokens=False).input_ids],
                          SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in tok.decode(out)


def test_the_gemm_pool_changes_no_token(shipped, chat_prompts):
    """parallel.cpu.qgemm_threads (cluster.yaml ships 2): on one torch thread a batch's 4-bit GEMMs split
    their output columns between the caller and pool.c's helper; every greedy token stays what the
    caller's thread alone gives (each output column is one thread's, summed in one order)."""
    if not cpu_qgemm.available():
        pytest.skip("no AVX-512 VNNI on this CPU (or no C compiler)")
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    threads, before = torch.get_num_threads(), cpu_qgemm.POOL.threads
    try:
        torch.set_num_threads(1)
        cpu_qgemm.POOL.threads = 0
        alone = shipped.generate(chat_prompts, greedy)
        cpu_qgemm.POOL.threads = 2
        assert shipped.generate(chat_prompts, greedy) == alone
    finally:
        cpu_qgemm.POOL.threads = before
        torch.set_num_threads(threads)
