"""The one place where sequences become tensors: ids, positions, slot mapping, attention metadata."""

from __future__ import annotations

import torch

from rayllm.attention.base import AttentionBackend, AttentionMetadata, AttentionMetadataBuilder
from rayllm.platforms.cpu.onednn import OneDNNWeight
from rayllm.platforms.cpu.split_step import HalfThread, VocabHalves, split_point
from rayllm.runner.input_buffers import InputBuffers
from rayllm.sample.logprobs import PromptRows, sliced_prompt_logprobs
from rayllm.sample.sampling_inputs import SamplingInputs
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
        # The backend says what metadata its layers read (attention/base.py); stand-ins take the torch path's.
        torch_only = getattr(model, "torch_attention_only", False)
        self.attn_builder = (backend.metadata_builder(block_size, kv_caches, torch_only) if backend is not None
                             else AttentionMetadataBuilder(block_size, kv_caches))
        kernels = backend.kernels if backend is not None else None
        self.argmax = kernels.argmax if kernels is not None else None  # greedy straight from bf16 logits
        self.halves: HalfThread | None = None  # see enable_halves
        self.half_step_tokens = 0
        # The most rows one LM-head call of a step took since start: sampled rows (at most max_num_seqs) or
        # a slice of prompt rows (logprobs.slice_rows), never a whole prompt chunk.
        self.largest_logits_rows = 0

    def enable_halves(self, min_tokens: int) -> None:
        """Steps of `min_tokens`+ tokens run in two halves on two threads, and other steps' LM head in two halves
        of the vocabulary (split_step.py); the CPU platform asks for it (one torch thread, a single rank). Only
        with the C attention kernels, whose inputs are per sequence."""
        if min_tokens > 0 and self.attn_builder.kernels:
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

    def prepare(self, step: StepInput, lora: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Per-step tensors; Python work is O(new tokens + blocks), never O(context length). Every
        integer input goes to the device in one copy (input_buffers.py); the rest is built there.
        lora=False: the caller has set the adapters' batch (a half step's adapters are all the base)."""
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        if self.lora is not None and lora:  # each token's adapter slot, for the LoRA deltas inside the linears
            self.lora.set_batch([s.lora_slot for s in step.seqs], [len(s.token_ids) for s in step.seqs])
        meta = self.attn_builder.step()
        for s in step.seqs:
            n = len(s.token_ids)
            q_start = len(ids)
            ids.extend(s.token_ids)
            end = s.start_pos + n
            positions.extend(range(s.start_pos, end))
            slot_mapping.extend(self._slots(s.block_table, s.start_pos, end))
            meta.add(q_start, n, s.block_table, end)
        tensors = iter(self.buffers.upload([ids, positions, slot_mapping, *meta.host_lists()]))
        ids_t, positions_t, slots_t = next(tensors), next(tensors), next(tensors)
        return ids_t, positions_t, meta.build(slots_t, tensors)

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
        with self.halves.running():
            later = self.halves.submit(self._half, second, [r - split for r in rows if r >= split])
            try:
                hidden, logits = self._half(first, [r for r in rows if r < split])
            finally:
                hidden2, logits2 = later.result()  # the other half still writes this step's KV: wait for it
        parts = [x for x in (logits, logits2) if x is not None]
        return torch.cat([hidden, hidden2]), (torch.cat(parts) if len(parts) > 1 else parts[0] if parts else None)

    def _half(self, step: StepInput, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_ids, positions, meta = self.prepare(step, lora=False)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, self.model.compute_logits(hidden[rows]) if rows else None

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.largest_logits_rows = max(self.largest_logits_rows, hidden.shape[0])
        return self.model.compute_logits(hidden)

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
        self.sampling.preempted(step.preempted_request_ids)
        errors: dict[str, str] = {}
        step = self._known_adapters(step, errors)
        if not step.seqs:
            return StepOutput({}, {}, {}, errors=errors) if self.is_driver else None
        # Rows whose logits come in one piece: the last token of each sampling sequence. Prompt rows asked
        # for come after the forward, in slices of bounded size (sample/logprobs.py).
        rows: list[int] = []
        prompt: list[PromptRows] = []
        offset = 0
        for s in step.seqs:
            n = len(s.token_ids)
            if s.prompt_logprob_targets:
                prompt.append(PromptRows(s, offset))
            if s.sample:
                rows.append(offset + n - 1)
            offset += n
        cut = 0
        if self.halves is not None and torch.get_num_threads() == 1:
            cut = split_point(step.seqs, self.block_size, self.half_step_tokens)
        if cut:
            hidden, logits = self._forward_halves(step, cut, rows)
            self.largest_logits_rows = max(self.largest_logits_rows, len(rows))
        else:
            hidden = self.forward(step)
            # Logits stay in the model dtype (the LM head's output precision); the sampler upcasts the
            # rows that need more than an argmax. Copying [B, vocab] fp32 tensors costs ms per step.
            # Every rank joins the LM head's collective in lockstep, or none does (no rows).
            logits = self._logits(hidden[rows] if len(rows) < hidden.shape[0] else hidden) if rows else None
        if not self.is_driver:
            if prompt:  # the same LM-head calls as the driver's (a collective under tensor parallelism)
                sliced_prompt_logprobs(hidden, prompt, self.vocab_size, self._logits, gather=False)
            return None
        out = StepOutput({}, {}, {}, errors=errors, pooled=self._pool(step, hidden))
        sampling = [s for s in step.seqs if s.sample]
        if logits is not None:
            result = self.sampling.sample(sampling, logits, self.argmax)
            out.sampled, out.logprobs = result.sampled, result.logprobs
            errors.update(result.errors)
            for i, s in enumerate(sampling):
                if s.request_id in out.sampled and s.params and s.params.return_hidden_states:
                    out.hidden_states[s.request_id] = hidden[rows[i]].float().tolist()
            del logits  # before the prompt slices' logits
        if prompt:
            got = sliced_prompt_logprobs(hidden, prompt, self.vocab_size, self._logits, gather=True, skip=errors)
            out.prompt_logprobs = got.logprobs
            errors.update(got.errors)
        return out
