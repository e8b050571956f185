"""LoRA on CUDA (the Triton shrink/expand kernels, rayllm/lora/triton_kernels.py) against PEFT, the
reference: prefill logits (eager) and greedy decode of a mixed batch of base and several adapters with
CUDA graphs on and off (with graphs the adapter slots are a graph input). Random-weight tiny Llama and
random adapters (peft's own files). Written on a CPU-only machine; runs wherever CUDA is present."""

from __future__ import annotations

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.schema.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from rayllm.schema.sampling_params import SamplingParams
from tests.lora.test_lora_reference import peft_adapter, save_small_base

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(autouse=True, scope="module")
def exact_fp32():
    """fp32 on both sides in full precision: TF32 would make greedy comparisons flaky."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def adapters(tmp_path):
    base = save_small_base(tmp_path)
    refs = {11: peft_adapter(base, str(tmp_path / "a"), rank=8, alpha=16, targets=ALL, seed=1),
            12: peft_adapter(base, str(tmp_path / "b"), rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                             seed=2, rslora=True),
            13: peft_adapter(base, str(tmp_path / "c"), rank=16, alpha=16, targets=ALL, seed=3)}
    return base, refs, {11: str(tmp_path / "a"), 12: str(tmp_path / "b"), 13: str(tmp_path / "c")}


def config(base: str, graphs: bool, dtype: str = "float32") -> EngineConfig:
    """A fixed cache of 256 blocks: on CUDA kv_cache_bytes counts for nothing (the engine would size 0.85 of
    the GPU from what is free, and serve_device.sh runs this lane just after its server's engines let go)."""
    return EngineConfig(model=ModelConfig(model=base, dtype=dtype), cache=CacheConfig(num_blocks_override=256),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        parallel=ParallelConfig(device="cuda", cuda_graphs=graphs),
                        lora=LoRAConfig(max_loras=4, max_lora_rank=16))


def test_prefill_logits_match_peft(tmp_path):
    base, refs, paths = adapters(tmp_path)
    ids = [int(x) for x in torch.randint(0, 300, (37,), generator=torch.Generator().manual_seed(3))]
    executor = make_executor(config(base, graphs=False), base, read_arch(base))
    try:
        for slot, (lora_id, path) in enumerate(paths.items(), start=1):
            executor.load_lora(slot, lora_id, path)
        for lora_id, ref in refs.items():
            with torch.no_grad():
                want = ref(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(executor.score(ids, lora_id).cpu(), want, atol=1e-4, rtol=1e-4)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_batch_greedy_matches_peft(tmp_path, graphs):
    base, refs, paths = adapters(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [[int(x) for x in torch.randint(0, 300, (n,), generator=g)] for n in (5, 9, 13)]
    jobs = [(p, lora) for p in prompts for lora in (0, 11, 12, 13)]
    want = []
    for prompt, lora in jobs:
        ref = refs[lora or 11]
        with torch.no_grad():
            if lora:
                out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
            else:
                with ref.disable_adapter():
                    out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        want.append(out[0, len(prompt):].tolist())
    engine = LLMEngine(config(base, graphs))
    try:
        assert (engine.executor.worker.runner.graphs is not None) == graphs
        for slot, (lora_id, path) in enumerate(paths.items(), start=1):
            engine.executor.load_lora(slot, lora_id, path)
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for i, (prompt, lora) in enumerate(jobs):
            engine.add_request(f"r{i}", prompt, params, lora_slot=lora)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(jobs))}
        while engine.has_work():
            for o in engine.step():
                got[o.request_id].extend(o.new_token_ids)
        # Base-model requests alone (adapters still loaded): their decode steps replay the graphs without
        # the LoRA kernels, and still answer as the base model.
        base_jobs = [i for i, (_, lora) in enumerate(jobs) if not lora]
        runner_graphs = engine.executor.worker.runner.graphs
        before = dict(runner_graphs.replays) if graphs else {}
        base_out = engine.generate([jobs[i][0] for i in base_jobs], params)
    finally:
        engine.shutdown()
    assert [got[f"r{i}"] for i in range(len(jobs))] == want
    assert base_out == [want[i] for i in base_jobs]
    if graphs:
        assert set(runner_graphs.graphs) == {(s, a) for s in runner_graphs.sizes for a in (False, True)}
        assert runner_graphs.replays[False] > before[False] and runner_graphs.replays[True] == before[True]
