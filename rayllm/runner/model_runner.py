"""The one place where sequences become tensors: ids, positions, slot mapping, attention metadata."""

from __future__ import annotations

import bisect

import torch

from rayllm.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk, decode_gather_index
from rayllm.common.errors import describe
from rayllm.platforms.cpu.onednn import OneDNNWeight
from rayllm.platforms.cpu.split_step import HalfThread, VocabHalves, split_point
from rayllm.runner.input_buffers import InputBuffers
from rayllm.sample.sampling_inputs import SamplingInputs, prompt_logprobs
from rayllm.schema.step import StepInput, StepOutput


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, vocab_size: int, device: torch.device, is_driver: bool,
                 lora=None):
        self.model = model
        self.lora = lora  # a rayllm.lora.layers.LoRAManager when adapters are enabled
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.is_driver = is_driver
        self.sampling = SamplingInputs(vocab_size)  # per-request generators; sampling on the logits' device
        self.buffers = InputBuffers(device)
        self.graphs = None  # a cuda_graphs.DecodeGraphs, set by the worker once captured
        backend: AttentionBackend | None = getattr(model, "attn_backend", None)  # None: test stand-ins
        self.needs_context_slots = backend is not None and backend.needs_context_slots
        # The C and Triton kernels read block tables and lengths directly, for decode and prefill alike;
        # the torch path needs masks, gather indices and context slots built from them. Models with
        # sliding-window or soft-capped layers keep the torch path unless the backend does both (Triton).
        kernels = backend.kernels if backend is not None else None
        self.paged_kernels = (kernels is not None and bool(kv_caches)
                              and kv_caches[0][0].dtype in kernels.attention_dtypes
                              and (not getattr(model, "torch_attention_only", False)
                                   or (backend is not None and backend.windows_and_softcap)))
        self.seq_tables = self.paged_kernels or self.needs_context_slots  # every sequence's block table, int32
        self.argmax = kernels.argmax if kernels is not None else None  # greedy straight from bf16 logits
        self.halves: HalfThread | None = None  # see enable_halves
        self.half_step_tokens = 0

    def enable_halves(self, min_tokens: int) -> None:
        """CPU, one torch thread, a single rank: steps of `min_tokens`+ tokens run in two halves on two
        threads, and other steps' LM head in two halves of the vocabulary (split_step.py). Only with
        the C attention kernels, whose inputs are per sequence."""
        if min_tokens > 0 and self.paged_kernels and self.device.type == "cpu":
            self.halves = HalfThread()
            self.half_step_tokens = min_tokens
            head = getattr(self.model, "lm_head", None)
            if head is not None and isinstance(head.large_batch_method, OneDNNWeight):
                head.set_large_batch_method(VocabHalves(head.weight.data, self.halves))

    def close(self) -> None:
        if self.halves is not None:
            self.halves.close()

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _context_slots(self, blocks: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """Cache slots of positions 0..ctx_len-1 from a sequence's blocks, on the device."""
        bs = self.block_size
        return (blocks.unsqueeze(1) * bs + torch.arange(bs, device=blocks.device)).flatten()[:ctx_len]

    def prepare(self, step: StepInput, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Per-step tensors; Python work is O(new tokens + blocks), never O(context length). Every
        integer input goes to the device in one copy (input_buffers.py); the rest is built there.
        lora=False: the caller has set the adapters' batch (a half step's adapters are all the base)."""
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        chunks: list[tuple[int, int, int, list[int]]] = []  # prefill: q_start, q_len, ctx_len, blocks
        q_lens: list[int] = []
        ctx_lens: list[int] = []
        bs = self.block_size
        if self.lora is not None and lora:  # each token's adapter slot, for the LoRA deltas inside the linears
            self.lora.set_batch([s.lora_slot for s in step.seqs], [len(s.token_ids) for s in step.seqs])
        seq_tables: list[list[int]] = []
        ctx_blocks: list[list[int]] = []
        q_starts: list[int] = []
        for s in step.seqs:
            n = len(s.token_ids)
            q_start = len(ids)
            ids.extend(s.token_ids)
            end = s.start_pos + n
            positions.extend(range(s.start_pos, end))
            slot_mapping.extend(self._slots(s.block_table, s.start_pos, end))
            q_lens.append(n)
            blocks = s.block_table[: -(-end // bs)]
            # Blocks behind every layer's window were freed (block_manager.FREED): the context is gathered
            # from the first live block on; every mask is relative to the context's end, so none changes.
            dropped = bisect.bisect_left(blocks, True, key=lambda b: b >= 0) if blocks[0] < 0 else 0
            blocks = blocks[dropped:]
            ctx = end - dropped * bs
            ctx_lens.append(ctx)
            ctx_blocks.append(blocks)
            is_decode = n == 1 and not chunks and len(decode_lens) == len(q_lens) - 1
            if self.seq_tables:
                seq_tables.append(blocks)
                q_starts.append(q_start)
                if is_decode:
                    decode_lens.append(ctx)
            elif is_decode:
                decode_tables.append(blocks)
                decode_lens.append(ctx)
            else:
                chunks.append((q_start, n, ctx, blocks))
        parts: list[list[int]] = [ids, positions, slot_mapping]
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            parts += [[b for t in decode_tables for b in t + [0] * (width - len(t))], decode_lens]
        if seq_tables:
            width = max(len(t) for t in seq_tables)
            parts += [[b for t in seq_tables for b in t + [0] * (width - len(t))], ctx_lens, q_starts, q_lens]
        parts += [c[3] for c in chunks if c[1] != c[2]]  # blocks of chunks after a cached prefix
        if self.needs_context_slots:
            parts += ctx_blocks
        tensors = iter(self.buffers.upload(parts))
        ids_t, positions_t, slots_t = next(tensors), next(tensors), next(tensors)
        tables_t = mask_t = gather_t = None
        if decode_tables:
            tables_t = next(tensors).view(len(decode_tables), -1)
            lens_t = next(tensors)
            mask_t = torch.arange(tables_t.shape[1] * bs, device=lens_t.device).unsqueeze(0) < lens_t.unsqueeze(1)
            num_kv_heads, num_blocks = self.kv_caches[0][0].shape[:2]
            gather_t = decode_gather_index(tables_t, num_kv_heads, num_blocks)
        kernel_args = {}
        if seq_tables:
            table, lens, starts, qlens = (next(tensors).int() for _ in range(4))
            kernel_args = dict(seq_block_tables=table.view(len(seq_tables), -1), seq_ctx_lens=lens,
                               seq_q_starts=starts, seq_q_lens=qlens)
        prefills = []
        for q_start, n, end, _ in chunks:
            if n == end:  # the chunk is the whole context: attends to its own keys, causally
                prefills.append(PrefillChunk(q_start, n, end, None, None))
                continue
            dev = slots_t.device
            mask = torch.arange(end, device=dev).unsqueeze(0) <= torch.arange(end - n, end, device=dev).unsqueeze(1)
            prefills.append(PrefillChunk(q_start, n, end, self._context_slots(next(tensors), end), mask))
        ctx_slots = None
        if self.needs_context_slots:
            ctx_slots = torch.cat([self._context_slots(next(tensors), c) for c in ctx_lens])
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            num_decode=len(decode_lens),
            block_size=bs,
            decode_block_tables=tables_t,
            decode_mask=mask_t,
            decode_gather_index=gather_t,
            prefills=prefills,
            q_lens=q_lens,
            ctx_lens=ctx_lens,
            ctx_slots=ctx_slots,
            **kernel_args,
        )
        return ids_t, positions_t, meta

    def forward(self, step: StepInput) -> torch.Tensor:
        """Hidden states of the step's tokens: a captured decode graph when one covers it, else eager."""
        if self.graphs is not None:
            hidden = self.graphs.run(step.seqs)
            if hidden is not None:
                return hidden
        input_ids, positions, meta = self.prepare(step)
        return self.model(input_ids, positions, self.kv_caches, meta)

    def model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        return self.model(input_ids, positions, self.kv_caches, meta)

    def model_forward_pieces(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                             pieces: int):
        return self.model.forward_pieces(input_ids, positions, self.kv_caches, meta, pieces)

    def _known_adapters(self, step: StepInput, errors: dict[str, str]) -> StepInput:
        """Drop sequences tagged with an adapter this rank does not hold (unloaded under them): each
        fails alone. Every rank holds the same adapters, so every rank drops the same sequences."""
        loaded = self.lora.id_to_slot if self.lora is not None else {}
        unknown = {s.request_id for s in step.seqs if s.lora_slot and s.lora_slot not in loaded}
        if not unknown:
            return step
        for rid in unknown:
            errors[rid] = "the LoRA adapter of this request is no longer loaded"
        return StepInput([s for s in step.seqs if s.request_id not in unknown], step.finished_request_ids)

    def _forward_halves(self, step: StepInput, cut: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states of the whole step and logits of `rows` (ascending, as execute builds them), the
        sequences before `cut` on this thread and the rest on the half thread."""
        assert self.halves is not None
        if self.lora is not None:  # every sequence is on the base model (split_point): no adapter rows
            self.lora.set_batch([0] * len(step.seqs), [len(s.token_ids) for s in step.seqs])
        first, second = StepInput(step.seqs[:cut]), StepInput(step.seqs[cut:])
        split = sum(len(s.token_ids) for s in first.seqs)
        self.halves.steps += 1
        self.halves.idle = False
        try:
            later = self.halves.submit(self._half, second, [r - split for r in rows if r >= split])
            try:
                hidden, logits = self._half(first, [r for r in rows if r < split])
            finally:
                hidden2, logits2 = later.result()  # the other half still writes this step's KV: wait for it
        finally:
            self.halves.idle = True
        parts = [x for x in (logits, logits2) if x is not None]
        return torch.cat([hidden, hidden2]), (torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None)

    def _half(self, step: StepInput, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids, positions, meta = self.prepare(step, lora=False)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, self.model.compute_logits(hidden[rows]) if rows else None

    @staticmethod
    def _pool(step: StepInput, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Pooling sequences' share of the final-norm hidden states (see SeqStep.pool), in fp32."""
        pooled: dict[str, list[float]] = {}
        offset = 0
        for s in step.seqs:
            n = len(s.token_ids)
            if s.pool == "last":
                pooled[s.request_id] = hidden[offset + n - 1].float().tolist()
            elif s.pool == "mean":
                pooled[s.request_id] = hidden[offset : offset + n].float().sum(0).tolist()
            offset += n
        return pooled

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput | None:
        self.sampling.forget(step.finished_request_ids)
        errors: dict[str, str] = {}
        step = self._known_adapters(step, errors)
        if not step.seqs:
            return StepOutput({}, {}, {}, errors=errors) if self.is_driver else None
        # Rows whose logits we need: the last token of sampling sequences, and all prompt rows asked for.
        rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: dict[str, tuple[int, int]] = {}
        offset = 0
        for s in step.seqs:
            n = len(s.token_ids)
            if s.prompt_logprob_targets:
                count = len(s.prompt_logprob_targets)
                prompt_rows[s.request_id] = (len(rows), count)
                rows.extend(range(offset, offset + count))
            if s.sample:
                sample_rows.append(len(rows))
                rows.append(offset + n - 1)
            offset += n
        cut = 0
        if self.halves is not None and torch.get_num_threads() == 1:
            cut = split_point(step.seqs, self.block_size, self.half_step_tokens)
        if cut:
            hidden, logits = self._forward_halves(step, cut, rows)
        else:
            hidden = self.forward(step)
            # Logits stay in the model dtype (the LM head's output precision); the sampler upcasts the
            # rows that need more than an argmax. Copying [B, vocab] fp32 tensors costs ms per step.
            # Every rank joins the LM head's collective in lockstep, or none does (no rows).
            logits = self.model.compute_logits(hidden[rows] if len(rows) < hidden.shape[0] else hidden) if rows else None
        pooled = self._pool(step, hidden) if self.is_driver else {}
        if logits is None:
            return StepOutput({}, {}, {}, errors=errors, pooled=pooled) if self.is_driver else None
        if not self.is_driver:
            return None
        sampling = [s for s in step.seqs if s.sample]
        out = StepOutput({}, {}, {}, errors=errors, pooled=pooled)
        if sampling:
            rows_needed = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            result = self.sampling.sample(sampling, rows_needed, self.argmax)
            out.sampled, out.logprobs = result.sampled, result.logprobs
            errors.update(result.errors)
            for i, s in enumerate(sampling):
                if s.request_id in out.sampled and s.params and s.params.return_hidden_states:
                    out.hidden_states[s.request_id] = hidden[rows[sample_rows[i]]].float().tolist()
        for s in step.seqs:
            if s.request_id in prompt_rows and s.params is not None and s.request_id not in errors:
                first, count = prompt_rows[s.request_id]
                try:
                    out.prompt_logprobs[s.request_id] = prompt_logprobs(
                        logits[first : first + count], s.prompt_logprob_targets, s.params.prompt_logprobs or 0)
                except Exception as exc:  # this sequence's own rows: it fails alone
                    errors[s.request_id] = describe(exc)
        return out
