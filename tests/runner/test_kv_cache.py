"""KV cache sizing and allocation: a budget that holds no blocks stops the engine at start with an error naming
the knob; a CPU cache is zeros that take memory only where written."""

from __future__ import annotations

import os

import pytest
import torch

from rayllm.engine.engine import LLMEngine
from rayllm.schema.config import CacheConfig, EngineConfig, ParallelConfig


def test_engine_with_no_room_for_kv_fails_at_start_naming_the_budget():
    config = EngineConfig(cache=CacheConfig(kv_cache_bytes=4096), parallel=ParallelConfig(device="cpu"))
    with pytest.raises(RuntimeError, match="KV cache budget holds 0 blocks.*kv_cache_bytes 4096"):
        LLMEngine(config)


def test_profile_step_is_the_largest_step_on_disjoint_blocks():
    from rayllm.runner.kv_cache import profile_step

    step, num_blocks = profile_step(max_tokens=1000, max_seqs=64, block_size=16)
    assert sum(len(s.token_ids) for s in step.seqs) == 1000 and len(step.seqs) == 64
    assert all(s.sample and s.start_pos == 0 for s in step.seqs)  # logits for every sequence
    blocks = [b for s in step.seqs for b in s.block_table]
    assert sorted(blocks) == list(range(num_blocks))  # disjoint, and exactly what the profile allocates
    assert all(len(s.block_table) * 16 >= len(s.token_ids) for s in step.seqs)
    step, _ = profile_step(max_tokens=8, max_seqs=64, block_size=16)
    assert len(step.seqs) == 8  # never more sequences than tokens


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_cache_is_zeros_resident_only_where_written():
    """A CPU cache reads as zeros everywhere, takes memory only for the pages written (a 1 GiB budget costs no
    start-up time, nor memory before its blocks are used), and its per-layer views write through to it."""
    from rayllm.runner.kv_cache import allocate

    layers, blocks, bs, heads, dim = 4, 2048, 16, 2, 128  # 64 MiB in bf16
    before = _rss_bytes()
    caches = allocate(layers, blocks, bs, heads, dim, torch.bfloat16, "cpu")
    assert _rss_bytes() - before < 8 << 20  # nothing touched yet
    k, v = caches[2]
    assert k.shape == v.shape == (heads, blocks, bs, dim) and k.dtype == torch.bfloat16
    k[1, 7].fill_(1.5)
    v[0, 3, 2] = 2.0
    assert _rss_bytes() - before < 8 << 20  # the pages written, not the cache
    assert float(k.float().sum()) == 1.5 * bs * dim and float(v.float().sum()) == 2.0 * dim  # zeros elsewhere
    assert float(sum(kc.float().sum() + vc.float().sum() for kc, vc in caches)) == 1.5 * bs * dim + 2.0 * dim


GiB = 1 << 30


@pytest.mark.parametrize("others,want", [
    (0, 72 - 16 - 2),  # alone: 90 % of the card, less our weights and the step's activations
    (4, 72 - 16 - 2),  # another process's 4 GiB is its own, not charged to this instance's share
    (30, 80 - 16 - 30 - 2),  # ... until the share no longer fits: capped by what is free
])
def test_cuda_budget_is_this_instance_share_capped_by_free(monkeypatch, others, want):
    """vLLM's gpu_memory_utilization: this instance's share of the card. CUDA itself is mocked (no GPU
    here): an 80 GiB card on which this process holds 16 GiB of weights and other processes `others` GiB."""
    from rayllm.runner import kv_cache

    total, own = 80 * GiB, 16 * GiB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total - own - others * GiB, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: own)
    assert kv_cache.cuda_budget(0.9, torch.device("cuda", 0), 2 * GiB) == want * GiB
