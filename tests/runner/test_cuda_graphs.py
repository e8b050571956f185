"""Decode CUDA graphs: the device-agnostic part, on CPU.

Capture and replay need CUDA (tests/gpu covers them). Here DecodeGraphs runs with capture=False: the
same static buffers, padding, staging and fixed-shape metadata, executed eagerly. A one-layer
attention "model" (random q/k/v looked up from the token id and position) is run both through the
runner's eager prepare() and through the graph path with padding; they must agree, and padding rows
may write only the scratch block. Attention backends: torch SDPA and xformers (CPU stand-in, see
xformers_standin.py, since xformers needs CUDA).
"""

from __future__ import annotations

import types

import pytest
import torch
from xformers_standin import install_fake_xformers  # tests/ is on sys.path under pytest (its conftest)

from rayllm.attention.sdpa import SDPAAttention
from rayllm.attention.xformers import XformersAttention
from rayllm.runner.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from rayllm.runner.model_runner import ModelRunner
from rayllm.schema.step import SeqStep, StepInput

HQ, HK, D, BS, NUM_BLOCKS, WIDTH = 4, 2, 8, 4, 24, 6


def test_ladder_and_padding():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert capture_sizes(1) == [1]
    sizes = capture_sizes(48)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 17, 33, 48, 49)] == [1, 4, 8, 32, 48, 48, None]


class OneLayer:
    """Token id and position pick fixed random q/k/v rows; then the backend's paged attention."""

    def __init__(self, attn, caches) -> None:
        gen = torch.Generator().manual_seed(1)
        self.attn_backend, self.caches = attn, caches
        self.q = torch.randn(50, 64, HQ, D, generator=gen)
        self.k = torch.randn(50, 64, HK, D, generator=gen)
        self.v = torch.randn(50, 64, HK, D, generator=gen)

    def __call__(self, ids, positions, kv_caches, meta):
        q, k, v = self.q[ids, positions], self.k[ids, positions], self.v[ids, positions]
        return self.attn_backend(q, k, v, *kv_caches[0], meta)


def _setup(kind: str, monkeypatch):
    torch.manual_seed(0)
    head_major = (torch.randn(HK, NUM_BLOCKS + 1, BS, D), torch.randn(HK, NUM_BLOCKS + 1, BS, D))
    if kind == "sdpa":
        attn, cache = SDPAAttention(), head_major
    else:
        install_fake_xformers(monkeypatch)
        attn, cache = XformersAttention(), tuple(c.permute(1, 2, 0, 3).contiguous() for c in head_major)
    return attn, cache


@pytest.mark.parametrize("kind", ["sdpa", "xformers"])
def test_padded_static_decode_equals_eager(kind, monkeypatch):
    attn, cache = _setup(kind, monkeypatch)
    eager_cache = tuple(c.clone() for c in cache)
    graph_cache = tuple(c.clone() for c in cache)
    runners = {}
    for name, c in (("eager", eager_cache), ("graph", graph_cache)):
        model = OneLayer(attn, [c])
        runners[name] = ModelRunner(model, [c], BS, vocab_size=50, device=torch.device("cpu"), is_driver=True)
    scratch = NUM_BLOCKS  # the extra block no sequence owns
    graphs = DecodeGraphs(max_num_seqs=8, max_blocks_per_seq=WIDTH, block_size=BS, scratch_block=scratch,
                          builder=runners["graph"].attn_builder, device=torch.device("cpu"), capture=False)
    graphs.capture(runners["graph"].model_forward)
    runners["graph"].graphs = graphs
    tables = [[7, 2, 19], [4], [11, 0, 23, 5], [3, 9]]
    # Three decode rows (padded to 4), then one (padded to 1), then all four: the static buffers are
    # reused, and a smaller step must not see the larger one's rows.
    for rows in ([(0, 9), (1, 2), (2, 14)], [(3, 6)], [(0, 10), (1, 3), (2, 15), (3, 7)]):
        seqs = [SeqStep(f"s{i}", [(5 * i + pos) % 50], pos, tables[i], sample=True) for i, pos in rows]
        assert graphs.size_for(seqs) == padded_size(len(seqs), graphs.sizes)
        pointers = (graphs.long_dev.data_ptr(), graphs.int_dev.data_ptr())
        out = runners["graph"].forward(StepInput(seqs))
        assert (graphs.long_dev.data_ptr(), graphs.int_dev.data_ptr()) == pointers
        expected = runners["eager"].forward(StepInput(seqs))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    scratch_rows = (slice(None), scratch) if kind == "sdpa" else (scratch,)
    for e, g in zip(eager_cache, graph_cache, strict=True):
        keep = torch.ones(NUM_BLOCKS + 1, dtype=torch.bool)
        keep[scratch] = False
        if kind == "sdpa":
            torch.testing.assert_close(g[:, keep], e[:, keep])  # only the scratch block differs
        else:
            torch.testing.assert_close(g[keep], e[keep])
        assert not torch.equal(g[scratch_rows], e[scratch_rows])  # padding rows wrote there


def test_steps_the_graphs_do_not_cover_run_eagerly(monkeypatch):
    attn, cache = _setup("sdpa", monkeypatch)
    builder = ModelRunner(OneLayer(attn, [cache]), [cache], BS, 50, torch.device("cpu"), True).attn_builder
    graphs = DecodeGraphs(4, WIDTH, BS, NUM_BLOCKS, builder, torch.device("cpu"), capture=False)
    prefill = [SeqStep("p", [1, 2, 3], 0, [1], sample=True)]
    too_many = [SeqStep(f"s{i}", [1], 2, [i], sample=True) for i in range(5)]
    too_long = [SeqStep("l", [1], WIDTH * BS, list(range(WIDTH + 1)), sample=True)]
    assert graphs.size_for(prefill) is None and graphs.size_for(too_many) is None
    assert graphs.size_for(too_long) is None
    graphs.forward = types.SimpleNamespace  # never called for these
    assert graphs.run(prefill) is None


@pytest.mark.parametrize("pieces", [1, 3, 5])
def test_pieces_of_a_decoder_run_as_the_whole(pieces):
    """A 5-layer decoder (random weights) decoded through DecodeGraphs in 1, 3 and 5 pieces (graphs per
    size on CUDA; here the same generator, run eagerly) equals the runner's eager forward."""
    from rayllm.layers.linear import TPGroup
    from rayllm.models.llama import LlamaForCausalLM
    from rayllm.schema.config import LlamaArch

    torch.manual_seed(3)
    arch = LlamaArch(hidden_size=32, intermediate_size=48, num_layers=5, num_heads=HQ, num_kv_heads=HK, head_dim=D,
                     vocab_size=50, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64,
                     tie_word_embeddings=True)
    model = LlamaForCausalLM(arch, TPGroup(), SDPAAttention())
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    caches = [(torch.randn(HK, NUM_BLOCKS + 1, BS, D), torch.randn(HK, NUM_BLOCKS + 1, BS, D)) for _ in range(5)]
    eager = ModelRunner(model, [tuple(c.clone() for c in kv) for kv in caches], BS, 50, torch.device("cpu"), True)
    graph = ModelRunner(model, caches, BS, 50, torch.device("cpu"), True)
    graphs = DecodeGraphs(8, WIDTH, BS, NUM_BLOCKS, graph.attn_builder, torch.device("cpu"), capture=False,
                          pieces=pieces)
    graphs.capture(graph.model_forward, forward_pieces=graph.model_forward_pieces)
    graph.graphs = graphs
    tables = [[7, 2, 19], [4, 8], [11, 0, 23]]
    step = StepInput([SeqStep(f"s{i}", [3 * i + 1], pos, tables[i], sample=True) for i, pos in enumerate((9, 5, 10))])
    scratch = [tuple(c.clone() for c in kv) for kv in caches]
    pieces_out = list(model.forward_pieces(*eager.prepare(step)[:2], scratch, eager.prepare(step)[2], pieces))
    assert len(pieces_out) == pieces and all(s is None for s in pieces_out[:-1])
    want = eager.forward(step)
    torch.testing.assert_close(pieces_out[-1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graph.forward(step), want, atol=1e-5, rtol=1e-5)
