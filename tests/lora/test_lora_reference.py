"""LoRA: our batched multi-adapter forward equals peft's reference at TP=1 and TP=2; mixed batches; bad files.

Every model here has RANDOM weights, as do the adapters (peft's own modules with fixed-seed random A and B, and
rayllm's random_peft_adapter): peft over the same base is the reference whatever the weights are. No test runs
the real model: every loader (GGUF's q/k un-permute included) hands the runner Hugging Face's layout, the one
adapters are written in, so LoRA has no GGUF-specific path (the base's GGUF loading is checked against
transformers in tests/engine and tests/loader). The bad-file test reads only the default model's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os

import pytest
import torch

from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.lora.files import LoRAError, random_peft_adapter, read_peft_adapter
from rayllm.schema.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def save_small_base(folder) -> str:
    """A tiny random Llama saved by transformers (3 KV heads: TP=2 splits them 2+1) in `folder`/base; the GPU
    lane's LoRA test (tests/gpu/test_gpu_lora.py) builds its base the same way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=3, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
    path = folder / "base"
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def small_base(tmp_path_factory) -> str:
    """save_small_base's model, shared by the module."""
    return save_small_base(tmp_path_factory.mktemp("lora-base"))


def peft_adapter(base: str, out: str, rank: int, alpha: int, targets: list[str], seed: int, rslora=False):
    """A peft model over the base with fixed-seed random A and B, saved by peft itself; returns it too."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, use_rslora=rslora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:  # peft initialises B to zero: randomise both so the adapter matters
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out)
    assert os.path.isfile(os.path.join(out, "adapter_model.safetensors"))
    return peft_model.eval()


@dataclasses.dataclass
class PeftCase:
    a_dir: str
    b_dir: str
    ids: list[int]
    expected_a: torch.Tensor
    expected_b: torch.Tensor
    expected_base: torch.Tensor


@pytest.fixture(scope="module")
def peft_case(small_base, tmp_path_factory) -> PeftCase:
    """Two peft adapters over the base and peft's logits for one prompt: made once, for both TP sizes."""
    all_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    out = tmp_path_factory.mktemp("peft")
    a_dir, b_dir = str(out / "a"), str(out / "b")
    ref_a = peft_adapter(small_base, a_dir, rank=8, alpha=16, targets=all_targets, seed=1)
    ref_b = peft_adapter(small_base, b_dir, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=2,
                         rslora=True)
    ids = [int(x) for x in torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(3))]
    with torch.no_grad():
        expected_a = ref_a(torch.tensor([ids])).logits[0]
        expected_b = ref_b(torch.tensor([ids])).logits[0]
        with ref_a.disable_adapter():
            expected_base = ref_a(torch.tensor([ids])).logits[0]
    return PeftCase(a_dir, b_dir, ids, expected_a, expected_b, expected_base)


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_match_peft_reference(small_base, peft_case, tp, request):
    if tp > 1:
        request.getfixturevalue("ray_local")
    base, case = small_base, peft_case
    a_dir, b_dir, ids = case.a_dir, case.b_dir, case.ids
    expected_a, expected_b, expected_base = case.expected_a, case.expected_b, case.expected_base
    assert (expected_a - expected_base).abs().max() > 0.1  # the adapters really change the output

    config = EngineConfig(
        model=ModelConfig(model=base, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=16 << 20),
        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu"),
        lora=LoRAConfig(max_loras=3, max_lora_rank=16),  # ranks 8 and 4 padded to 16
    )
    executor = make_executor(config, base, read_arch(base))
    try:
        assert executor.load_lora(3, 11, a_dir) == 8
        assert executor.load_lora(1, 12, b_dir) == 4
        got_a, got_b, got_base = (executor.score(ids, lora_id) for lora_id in (11, 12, 0))
        executor.unload_lora(3)
        got_after_unload = executor.score(ids, 12)
    finally:
        executor.shutdown()
    torch.testing.assert_close(got_a, expected_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, expected_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_base, expected_base, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_after_unload, expected_b, atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_each_request_alone(tiny_llama, chat_prompts, tmp_path):
    """Base + two adapters in one continuous batch: each request gets exactly its tokens when alone.
    On conftest's tiny_llama (RANDOM weights, the default model's vocabulary, so chat_prompts are valid
    inputs): which tokens come out does not matter, only that batching with other adapters changes none."""
    from rayllm.engine.engine import LLMEngine
    from rayllm.schema.sampling_params import SamplingParams

    arch = read_arch(tiny_llama)
    paths = [random_peft_adapter(str(tmp_path / f"ad{i}"), arch, rank=8, seed=i) for i in (1, 2)]
    config = EngineConfig(
        model=ModelConfig(model=tiny_llama, dtype="float32", max_model_len=512),
        cache=CacheConfig(kv_cache_bytes=64 << 20),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8),
    )
    engine = LLMEngine(config)
    try:
        engine.executor.load_lora(1, 101, paths[0])
        engine.executor.load_lora(2, 102, paths[1])
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        jobs = [(p, lora) for p in chat_prompts[:3] for lora in (0, 101, 102)]

        def run(batch):
            ids = [f"r{i}-{len(batch)}-{engine.num_steps}" for i in range(len(batch))]
            for rid, (prompt, lora) in zip(ids, batch, strict=True):
                engine.add_request(rid, prompt, params, lora_slot=lora)
            out = {rid: [] for rid in ids}
            while engine.has_work():
                for o in engine.step():
                    out[o.request_id].extend(o.new_token_ids)
            return [out[rid] for rid in ids]

        together = run(jobs)
        alone = [run([job])[0] for job in jobs]
    finally:
        engine.shutdown()
    assert together == alone
    for i in range(3):  # each adapter changes what the model says
        base, a, b = together[3 * i : 3 * i + 3]
        assert base != a and base != b and a != b


def _write(path, config: dict | None = None, tensors: dict | None = None, bin_file=False) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    if config is not None:
        with open(os.path.join(path, "adapter_config.json"), "w") as fh:
            json.dump(config, fh)
    if bin_file:
        torch.save(tensors or {}, os.path.join(path, "adapter_model.bin"))
    elif tensors is not None:
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def test_bad_adapters_are_refused_with_clear_errors(gguf_path, tmp_path):
    arch = read_arch(gguf_path)
    good = random_peft_adapter(str(tmp_path / "good"), arch, rank=4, seed=0, targets=("q_proj",))
    assert read_peft_adapter(good, arch, max_rank=64).rank == 4
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    ab = {f"{key}.lora_A.weight": torch.zeros(4, 576), f"{key}.lora_B.weight": torch.zeros(576, 4)}
    cases = {
        "does not exist": str(tmp_path / "missing"),
        "adapter_model.bin": _write(tmp_path / "bin", cfg, ab, bin_file=True),
        "no adapter_config.json": _write(tmp_path / "nocfg", None, ab),
        "max_lora_rank": random_peft_adapter(str(tmp_path / "big"), arch, rank=32, seed=0, targets=("q_proj",)),
        "another model": _write(tmp_path / "shape", cfg, {f"{key}.lora_A.weight": torch.zeros(4, 96),
                                                          f"{key}.lora_B.weight": torch.zeros(96, 4)}),
        "layer 40": _write(tmp_path / "layers", cfg, {k.replace("layers.0", "layers.40"): v for k, v in ab.items()}),
        "DoRA": _write(tmp_path / "dora", cfg | {"use_dora": True}, ab),
        "unsupported tensor": _write(tmp_path / "embed", cfg, ab | {"base_model.model.lm_head.lora_A.weight":
                                                                    torch.zeros(4, 576)}),
        "unreadable": _write(tmp_path / "junk", cfg, None),
    }
    with open(os.path.join(cases["unreadable"], "adapter_model.safetensors"), "wb") as fh:
        fh.write(b"not a safetensors file")
    for message, path in cases.items():
        with pytest.raises(LoRAError, match=message):
            read_peft_adapter(path, arch, max_rank=16)


async def test_registry_lru_eviction_busy_slots_and_deferred_unload(small_base, tmp_path):
    """Two slots: idle adapters are evicted least-recently-used first, busy ones never."""
    from rayllm.engine.client.engine_client import make_engine_client
    from rayllm.protocol.errors import APIError
    from rayllm.serve.lora.lora_registry import LoRARegistry

    base = small_base
    arch = read_arch(base)
    paths = {n: random_peft_adapter(str(tmp_path / n), arch, rank=4, seed=i) for i, n in enumerate("abcd")}
    config = EngineConfig(model=ModelConfig(model=base, dtype="float32"), cache=CacheConfig(kv_cache_bytes=8 << 20),
                          lora=LoRAConfig(max_loras=2, max_lora_rank=4, allowed_roots=(str(tmp_path),)))
    client = make_engine_client(config)  # the engine on a thread of this process, as a replica's
    executor = client.engine.executor
    evicted: list[str] = []
    registry = LoRARegistry(config.lora, client, on_evict=evicted.append, slot_wait_s=0.5)  # the 503 after a short wait
    try:
        ids = [1, 2, 3]
        a = await registry.acquire("a", paths["a"])  # busy
        await registry.load("b", paths["b"])
        await registry.load("c", paths["c"])  # evicts b (idle), not a (busy)
        assert registry.names() == ["a", "c"] and evicted == ["b"]
        c = await registry.acquire("c", paths["c"])
        with pytest.raises(APIError) as err:  # both slots busy
            await registry.load("d", paths["d"])
        assert err.value.status_code == 503
        queue: asyncio.Queue = asyncio.Queue()
        a.holders.add(queue)
        unloading = asyncio.create_task(registry.unload("a"))
        await asyncio.sleep(0.05)
        assert not unloading.done() and registry.names() == ["c"]  # deferred: a still runs
        assert queue.get_nowait().code == "lora_adapter_unloaded"  # its request is told to end
        assert executor.score(ids, a.lora_id) is not None
        registry.release(a, queue)  # last request of a ended: its slot is freed now
        assert await unloading
        d = await registry.load("d", paths["d"])
        assert d.slot == a.slot and d.lora_id not in (a.lora_id, c.lora_id)
        with pytest.raises(APIError) as err:
            await registry.load("e", str(tmp_path / "missing"))
        assert err.value.status_code == 400 and err.value.to_dict()["error"]["code"] == "invalid_lora_adapter"
        assert registry.names() == ["c", "d"]
    finally:
        client.shutdown()
