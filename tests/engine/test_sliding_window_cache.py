"""Sliding-window models in the paged cache (block_manager.py's window), against transformers.

The models are tiny and have RANDOM weights, built by transformers in the test: the checks are that
our engine computes what transformers computes while it frees the blocks behind the window.
transformers honours `sliding_window` for Mistral and Qwen2 with both its sdpa (the default, used
here) and eager attention; the test checks that the window changes its greedy output, so ignoring the
window could not pass.
"""

from __future__ import annotations

import pytest
import torch

from rayllm.engine.block_manager import FREED
from rayllm.engine.engine import LLMEngine
from rayllm.loader.loader import read_arch
from rayllm.models.registry import kv_window
from rayllm.runner.kv_cache import bytes_per_block
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from rayllm.schema.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it

VOCAB, WINDOW, BS, BUDGET, MAX_TOKENS = 256, 8, 4, 16, 40
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1)
# name -> (model_type, window options): every layer windowed, or (qwen2_partial) only layer 1.
MODELS = {
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    "qwen2_partial": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
}
NUM_BLOCKS = 16  # 64 tokens: less than one sequence's 70


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]


def save_model(path, name: str, **overrides) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, window = MODELS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **(window | overrides)),
                                             dtype=torch.float32)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {name: save_model(tmp_path_factory.mktemp(name), name) for name in MODELS}


PROMPTS = [ids(30, 1), ids(5, 2), ids(30, 1)[:21] + ids(3, 3)]  # the third shares 20 tokens (5 blocks) with the first


def generate_reference(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        x = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def check_gathered_blocks(engine: LLMEngine) -> None:
    """Wrap the runner's prepare (it still runs) to check each step's attention metadata: every block
    a sequence's attention gathers is one its table still holds, never a FREED entry's old block."""
    runner = engine.executor.worker.runner
    prepare = runner.prepare

    def checked(step):
        input_ids, positions, meta = prepare(step)
        for i, s in enumerate(step.seqs):  # decode rows first, then one chunk per sequence
            live = {b for b in s.block_table if b != FREED}
            if i < meta.num_decode:  # the gather index's first KV head rows are the decode rows' block tables
                width = meta.decode_mask.shape[1] // BS
                tables = meta.decode_gather_index[: meta.num_decode * width].view(meta.num_decode, width)
                gathered = tables[i, : -(-meta.ctx_lens[i] // BS)].tolist()
            else:
                chunk = meta.prefills[i - meta.num_decode]
                gathered = [] if chunk.slots is None else (chunk.slots // BS).tolist()
            assert set(gathered) <= live
        return input_ids, positions, meta

    runner.prepare = checked


def run_engine(path: str, prompts: list[list[int]], num_blocks: int) -> tuple[list[list[int]], LLMEngine, list[int], list[int]]:
    """Greedy outputs, the engine, and after each step the blocks in use and the FREED entries of the
    running sequences' tables."""
    arch = read_arch(path)
    per_block = bytes_per_block(arch.num_layers, arch.num_kv_heads, arch.head_dim, BS, torch.float32)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=path, dtype="float32"),
        cache=CacheConfig(kv_cache_bytes=num_blocks * per_block, block_size=BS, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET),
        parallel=ParallelConfig(device="cpu")))
    assert engine.executor.num_blocks == num_blocks
    check_gathered_blocks(engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    used, freed = [], []
    while engine.has_work():
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
        used.append(num_blocks - engine.block_manager.num_free_blocks)
        freed.append(0)
        for s in engine.scheduler.running:
            n = s.block_table.count(FREED)
            assert s.block_table[:n] == [FREED] * n  # no live block sits before a freed one
            freed[-1] += n
    return [results[str(i)] for i in range(len(prompts))], engine, used, freed


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_all_windowed_model_frees_blocks_and_matches_generate(checkpoints, name, tmp_path):
    """Each sequence reaches 70 tokens (18 blocks) in a 16-block cache: only freeing the blocks
    behind the 8-token window lets it run; greedy outputs still equal transformers' generate."""
    path = checkpoints[name]
    expected = generate_reference(path, PROMPTS)
    unwindowed = save_model(tmp_path / "full", name, sliding_window=None)
    assert generate_reference(unwindowed, PROMPTS[:1]) != expected[:1]  # the window changes the output
    got, engine, used, freed = run_engine(path, PROMPTS, NUM_BLOCKS)
    try:
        assert engine.block_manager.window == WINDOW
        assert len(PROMPTS[0]) + MAX_TOKENS > NUM_BLOCKS * BS
        assert got == expected
        assert max(freed) > 0
        # Decoding three sequences: each holds its window (8 tokens) and the block being written, at
        # most 3 blocks, where keeping everything would need 18 each.
        assert max(used[-MAX_TOKENS // 2:]) <= 3 * len(PROMPTS)
        assert engine.block_manager.prefix_hits > 0  # the shared prompt blocks came from the cache
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    finally:
        engine.shutdown()


def test_partly_windowed_model_keeps_every_block(checkpoints):
    """A global layer reads the whole context: no block can be freed, and the windowed layer still
    masks correctly (the outputs equal generate)."""
    path = checkpoints["qwen2_partial"]
    assert kv_window(read_arch(path)) is None
    prompts = PROMPTS[:2]
    got, engine, used, freed = run_engine(path, prompts, 64)
    try:
        assert got == generate_reference(path, prompts)
        assert engine.block_manager.window is None
        assert max(freed) == 0
        assert max(used) >= sum(-(-(len(p) + MAX_TOKENS - 2) // BS) for p in prompts)  # every block kept
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("model_type", "options", "window"), [
    ("gemma2", {}, None),  # alternates local and global layers
    ("gemma3_text", {}, None),  # five local layers per global one
    ("gemma3_text", {"layer_types": ["sliding_attention"] * 6}, WINDOW),  # every layer local
    ("mistral", {"sliding_window": 4096, "max_position_embeddings": 4096}, None),  # the window spans the context
    ("qwen2", {"sliding_window": WINDOW}, None),  # use_sliding_window is off
])
def test_which_configs_free_blocks(model_type, options, window, tmp_path):
    """kv_window from config.json alone: a window only when every layer has one (and it is shorter
    than the context)."""
    from transformers import AutoConfig

    cfg = dict(COMMON, num_hidden_layers=6, sliding_window=WINDOW, head_dim=16) | options
    AutoConfig.for_model(model_type, **cfg).save_pretrained(str(tmp_path))
    assert kv_window(read_arch(str(tmp_path))) == window
