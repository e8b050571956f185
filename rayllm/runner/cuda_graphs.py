"""CUDA graphs for decode steps (parallel.cuda_graphs; CUDA only, eager for prefill and mixed steps).

A small model's decode step is bound by kernel launches. Decode steps are captured once per batch size
of a ladder (1, 2, 4, ..., max_num_seqs) and a step is padded up to the next captured size. Inputs
live in static buffers (filled from one host staging buffer, one copy per dtype); the attention
metadata is rebuilt from them inside the graph, so its shapes are fixed per size: block tables are
max_blocks_per_seq wide and the Python-side lengths the kernels see are upper bounds. Padding rows
write their K/V into a scratch block that no sequence owns and attend to it alone.

Everything but the capture itself is device-agnostic (sizes, padding, staging, metadata) and tested
on CPU, where `capture=False` runs the same static-buffer path eagerly.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from rayllm.attention.base import AttentionMetadata, AttentionMetadataBuilder

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# (ids, positions, metadata, pieces) -> None at each pause between layers, then the hidden states.
Pieces = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, int], Iterator[torch.Tensor | None]]


def model_capturable(model: torch.nn.Module) -> bool:
    """Whether a decode step of `model` can be captured: no module of it says otherwise (a layer that reads
    device values on the host, such as FusedMoE's expert counts, sets `capturable = False`)."""
    return all(getattr(m, "capturable", True) for m in model.modules())


def leave_capture_stream(device: torch.device) -> None:
    """Back onto the default stream after a failed capture: torch.cuda.graph's __exit__ raises from
    capture_end before it restores the stream it entered, which would leave this thread's later (eager)
    work on the capture stream."""
    torch.cuda.set_stream(torch.cuda.default_stream(device))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to max_num_seqs, and max_num_seqs itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding n rows; None beyond the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 builder: AttentionMetadataBuilder, device: torch.device, capture: bool = True, pieces: int = 1) -> None:
        """builder: the runner's (its backend's) metadata builder. pieces: graphs per batch size, each a run of
        layers (model.forward_pieces), replayed in turn: a graph's launch costs host time per kernel, and the
        GPU waits for all of it before starting."""
        self.sizes = capture_sizes(max_num_seqs)
        self.width, self.block_size, self.scratch_block = max_blocks_per_seq, block_size, scratch_block
        self.builder = builder
        self.device = device
        self.capture_enabled = capture and device.type == "cuda"
        b, w = self.sizes[-1], max_blocks_per_seq
        pin = device.type == "cuda"
        # int64: token ids | positions | slots; int32: context lengths | query starts | block tables.
        self.long_host = torch.zeros(3 * b, dtype=torch.int64, pin_memory=pin)
        self.int_host = torch.zeros(2 * b + b * w, dtype=torch.int32, pin_memory=pin)
        self.long_dev = torch.zeros(3 * b, dtype=torch.int64, device=device)
        self.int_dev = torch.zeros(2 * b + b * w, dtype=torch.int32, device=device)
        # numpy views of the (pinned) host buffers: per-element writes cost ~0.1 us instead of a tensor op.
        self.long_np, self.int_np = self.long_host.numpy(), self.int_host.numpy()
        self.table_np = self.int_np[2 * b:].reshape(b, w)
        self.row_ids = np.arange(b, dtype=np.int32)
        self.ids, self.positions, self.slots = self.long_dev.view(3, b)
        self.ctx_lens, self.q_starts = self.int_dev[: 2 * b].view(2, b)
        self.tables = self.int_dev[2 * b:].view(b, w)
        # (batch size, adapters in the step) -> that size's graphs (one per piece) and their output.
        self.graphs: dict[tuple[int, bool], list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.forward: Forward | None = None
        self.pieces = pieces
        self.forward_pieces: Pieces | None = None
        # A rayllm.lora.layers.LoRAManager when adapters are enabled: each row's slot is a graph input of a
        # second set of graphs; steps of base-model rows only replay graphs without the LoRA kernels (a graph
        # cannot branch, and the kernels' launches would cost every base-model step).
        self.lora = None
        self.lora_host = torch.zeros(b, dtype=torch.int32, pin_memory=pin)
        self.lora_dev = torch.zeros(b, dtype=torch.int32, device=device)
        self.lora_np = self.lora_host.numpy()
        self.replays = {False: 0, True: 0}  # steps run per variant (tests read which one ran)

    def size_for(self, seqs) -> int | None:
        """The captured size for a step of decode rows only (one token each) that fits; else None."""
        if not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        if any(-(-(s.start_pos + 1) // self.block_size) > self.width for s in seqs):
            return None
        return padded_size(len(seqs), self.sizes)

    def variants(self) -> tuple[bool, ...]:
        """Whether a step has adapter rows, for each set of graphs captured."""
        return (False, True) if self.lora is not None else (False,)

    def with_adapters(self, seqs) -> bool:
        return self.lora is not None and any(s.lora_slot for s in seqs)

    def stage(self, seqs, size: int) -> None:
        """Write the step (padded to `size` rows) into the host staging buffers, then copy them once.
        Python work is O(rows + blocks in use), not O(rows * max_blocks_per_seq): table entries past a
        row's length keep stale (valid) block ids, which every backend masks by the context length."""
        b, bs = self.sizes[-1], self.block_size
        n = len(seqs)
        longs, ints, tables = self.long_np.reshape(3, b), self.int_np[: 2 * b].reshape(2, b), self.table_np
        # Padding rows: token 0 at position 0, written into the scratch block and attending to it alone.
        longs[:2, n:size] = 0
        longs[2, n:size] = self.scratch_block * bs
        ints[0, n:size] = 1
        ints[1, :size] = self.row_ids[:size]
        tables[n:size, 0] = self.scratch_block
        for i, s in enumerate(seqs):
            pos = s.start_pos
            used = pos // bs + 1
            longs[0, i], longs[1, i] = s.token_ids[0], pos
            longs[2, i] = s.block_table[pos // bs] * bs + pos % bs
            ints[0, i] = pos + 1
            tables[i, :used] = s.block_table[:used]
        nb = self.cuda_nonblocking()
        # Whole rows of the [3, b] / [2, b] buffers (a few KB): a [:, :size] slice is strided, and torch
        # copies a strided pinned source through a pageable clone and a scatter kernel, tens of us of
        # host time each on the GPU's timeline (docs/benchmarks.md), where a contiguous one is one DMA.
        self.long_dev.copy_(self.long_host, non_blocking=nb)
        self.int_dev[: 2 * b].copy_(self.int_host[: 2 * b], non_blocking=nb)
        self.tables[:size].copy_(self.int_host[2 * b:].view(b, self.width)[:size], non_blocking=nb)
        if self.lora is not None:  # padding rows: slot 0 (the base model)
            to_slot = self.lora.id_to_slot
            self.lora_np[:size] = 0
            for i, s in enumerate(seqs):
                self.lora_np[i] = to_slot.get(s.lora_slot, 0) if s.lora_slot else 0
            self.lora_dev.copy_(self.lora_host, non_blocking=nb)

    def cuda_nonblocking(self) -> bool:
        """Pinned staging reused each step: the previous copy must have left it (it has, since the step's
        results were read back), so a plain non_blocking copy is safe."""
        return self.device.type == "cuda"

    def metadata(self, size: int) -> AttentionMetadata:
        """Fixed-shape metadata over the static buffers' first `size` rows, as the backend's builder makes it
        (derived on the device, inside the graph)."""
        return self.builder.decode_graph(self.slots[:size], self.tables[:size], self.ctx_lens[:size],
                                         self.q_starts[:size], self.scratch_block + 1)

    def _bind(self, size: int, adapters: bool) -> None:
        if self.lora is not None:  # inside the (first piece's) capture: the grouping by slot is replayed too
            if adapters:
                self.lora.bind(self.lora_dev[:size])
            else:
                self.lora.clear_batch()

    def _run(self, size: int, adapters: bool = False) -> torch.Tensor:
        if self.forward_pieces is not None:
            *_, out = self._pieces(size, adapters)
            assert out is not None
            return out
        assert self.forward is not None
        self._bind(size, adapters)
        return self.forward(self.ids[:size], self.positions[:size], self.metadata(size))

    def _pieces(self, size: int, adapters: bool = False) -> Iterator[torch.Tensor | None]:
        """The metadata is built inside the first piece, so each replay rebuilds it from the buffers."""
        assert self.forward_pieces is not None
        self._bind(size, adapters)
        yield from self.forward_pieces(self.ids[:size], self.positions[:size], self.metadata(size), self.pieces)

    def capture(self, forward: Forward, capturable: Callable[[], bool] = lambda: True,
                forward_pieces: Pieces | None = None) -> bool:
        """Warm each size up eagerly (lazy initialisation, kernel choices), then capture it, largest first
        so the smaller graphs reuse its memory pool. `capturable` is asked after each warm-up (the
        attention backend may have fallen back to a path that copies from Python lists); False stops
        and leaves the graphs off, as does the torch attention path (its decode gathers whole tables).
        Returns whether the graphs (or, without capture, the path) are on; when off, a warning says why."""
        self.forward = forward
        self.forward_pieces = forward_pieces if self.pieces > 1 else None
        if not self.capture_enabled:
            return True
        if not self.builder.seq_tables:
            # The torch path's decode (attention/sdpa.py) gathers every row's whole block table: in a graph
            # that is the fixed width, [Hk, B, max_model_len, D] per layer (68 GB at 256 rows of 131k tokens),
            # where an eager step gathers only up to its longest context.
            log.warning("decode CUDA graphs off: the torch attention path would gather each row's whole "
                        "%d-token table width", self.width * self.block_size)
            self.forward = None
            return False
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for adapters in self.variants():  # the base set first: it must not depend on the adapters' capture
            try:
                for size in reversed(self.sizes):
                    self.stage([], size)
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(2):
                            self._run(size, adapters)
                    torch.cuda.current_stream().wait_stream(stream)
                    if not capturable():
                        log.warning("no paged decode kernel in xformers here: CUDA graphs off")
                        self.forward, self.graphs, self.outputs = None, {}, {}
                        return False
                    self._capture_size(size, adapters, pool)
            except Exception as exc:
                leave_capture_stream(self.device)
                if not adapters:
                    raise
                # Base-model steps keep their graphs; steps with adapter rows run eagerly.
                torch.cuda.synchronize(self.device)
                for key in [k for k in self.graphs if k[1]]:
                    del self.graphs[key], self.outputs[key]
                log.warning("CUDA graphs with adapter rows failed to capture, those steps run eagerly: %s", exc)
        if self.lora is not None:
            self.lora.clear_batch()
        torch.cuda.synchronize(self.device)
        with_adapters = any(k[1] for k in self.graphs)
        log.info("captured decode CUDA graphs for batch sizes %s (%d per size%s)", self.sizes,
                 len(self.graphs[self.sizes[0], False]), ", with and without adapter rows" if with_adapters else "")
        return True

    def _capture_size(self, size: int, adapters: bool, pool) -> None:
        """One graph, or one per piece: a piece's outputs stay referenced (by the generator) while the next is
        captured, so they live in the pool across the graphs' boundaries."""
        steps = self._pieces(size, adapters) if self.forward_pieces is not None else None
        key, out = (size, adapters), None
        self.graphs[key] = []
        while out is None:  # until the piece that returns the hidden states
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = next(steps) if steps is not None else self._run(size, adapters)
            self.graphs[key].append(graph)
        self.outputs[key] = out

    def run(self, seqs) -> torch.Tensor | None:
        """Hidden states of a decode step's rows (a view valid until the next run), or None when the
        step is not one the graphs cover (prefill, too many rows, a context past max_blocks_per_seq)."""
        size = self.size_for(seqs)
        if size is None or self.forward is None:
            return None
        key = (size, self.with_adapters(seqs))
        if self.capture_enabled and key not in self.graphs:
            return None  # adapter rows whose graphs could not be captured: the runner's eager path
        self.stage(seqs, size)
        self.replays[key[1]] += 1
        if key in self.graphs:
            for graph in self.graphs[key]:
                graph.replay()
            return self.outputs[key][: len(seqs)]
        return self._run(*key)[: len(seqs)]  # capture=False: the same static-buffer path, eagerly
