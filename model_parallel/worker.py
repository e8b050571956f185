"""One tensor-parallel rank: process group, model shard, weights, KV cache, model runner.

Used in-process when tensor_parallel_size is 1 and as a Ray actor per rank otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from model_parallel import kv_cache
from model_parallel.attention import make_attention_backend
from model_parallel.config import EngineConfig, LlamaArch
from model_parallel.loader import load_weights
from model_parallel.lora import LoRAManager
from model_parallel.model_runner import ModelRunner, SeqStep, StepInput, StepOutput
from model_parallel.parallel import (
    TPGroup,
    onednn_available,
    pack_small_batch_weights,
    prepack_onednn_weights,
)
from model_parallel.registry import model_class

log = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_device(choice: str) -> torch.device:
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


class Worker:
    def __init__(self, config: EngineConfig, model_path: str, arch: LlamaArch, rank: int, dist_init: str | None):
        self.config = config
        self.rank = rank
        world = config.parallel.tensor_parallel_size
        device = resolve_device(config.parallel.device)
        self.step_threads = self.single_sequence_threads = 0
        if device.type == "cuda":
            # Under Ray each rank sees only its own GPU; otherwise pick by rank.
            device = torch.device("cuda", 0 if os.environ.get("CUDA_VISIBLE_DEVICES") else rank)
            torch.cuda.set_device(device)
        else:
            threads = config.parallel.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // world)
            torch.set_num_threads(threads)
            self.step_threads = threads  # torch threads for a batch, and for one sequence alone:
            self.single_sequence_threads = config.parallel.cpu_threads_single_sequence
        self.device = device
        group = None
        if world > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=dist_init, rank=rank, world_size=world, timeout=timedelta(minutes=10)
            )
            group = dist.group.WORLD
        self.tp = TPGroup(rank, world, group)
        self.dtype = getattr(torch, config.model.torch_dtype_name)
        self.attn_backend = make_attention_backend(config.parallel.attention_backend, device)
        torch.manual_seed(config.model.seed)
        # Parameters are created in the target dtype on the target device: no fp32 copy of the model
        # ever exists. Rotary tables are built in float64 and stored fp32 explicitly, so they stay fp32.
        with torch.device(device), default_dtype(self.dtype):
            self.model = model_class(arch)(arch, self.tp, self.attn_backend)
        if config.model.weights == "quantized":
            from model_parallel.quant import load_quantized_weights

            source_bits: dict[str, int] = {}  # no small-batch copies: the quantized kernels serve every size
            log.info("kept %d layers quantized", load_quantized_weights(self.model, model_path))
        else:
            source_bits = load_weights(self.model, model_path, show_progress=rank == 0)
        invariant = config.scheduler.batch_invariant
        if (config.model.small_batch_quant == "auto" and not invariant and device.type == "cpu"
                and self.dtype == torch.bfloat16):
            packed = pack_small_batch_weights(self.model, source_bits)
            log.info("packed %d layers for small-batch weight-only kernels", packed)
        # Batch-invariant mode needs the prepacked layout: plain F.linear's rows vary with the row count.
        if (config.model.cpu_weight_prepack or invariant) and onednn_available(device, self.dtype):
            log.info("reordered %d weights into oneDNN's layout",
                     prepack_onednn_weights(self.model, batch_invariant=invariant))
        self.model.eval()
        self.arch = arch
        self.runner: ModelRunner | None = None
        self.lora = LoRAManager(self.model, config.lora, self.dtype, device) if config.lora.enabled else None

    def kv_bytes_per_block(self) -> int:
        attn = self.model.layers[0].self_attn.qkv_proj
        return kv_cache.bytes_per_block(
            self.arch.num_layers, attn.num_kv_heads, self.arch.head_dim, self.config.cache.block_size, self.dtype
        )

    def available_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks_override:
            return cache.num_blocks_override
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cuda":
            return kv_cache.blocks_for_budget(kv_cache.cuda_budget(cache.gpu_memory_utilization, self.device), per_block)
        return kv_cache.blocks_for_budget(cache.kv_cache_bytes, per_block)

    def init_cache(self, num_blocks: int) -> None:
        attn = self.model.layers[0].self_attn.qkv_proj
        caches = kv_cache.allocate(
            self.arch.num_layers,
            num_blocks,
            self.config.cache.block_size,
            attn.num_kv_heads,
            self.arch.head_dim,
            self.dtype,
            self.device,
        )
        self.runner = ModelRunner(
            self.model, caches, self.config.cache.block_size, self.arch.vocab_size, self.device, self.rank == 0,
            lora=self.lora,
        )

    def execute(self, step: StepInput) -> StepOutput | None:
        assert self.runner is not None, "init_cache first"
        if self.single_sequence_threads:
            want = self.single_sequence_threads if len(step.seqs) == 1 else self.step_threads
            if torch.get_num_threads() != want:  # ~1 us; only when the batch crosses one sequence
                torch.set_num_threads(want)
        return self.runner.execute(step)

    def load_lora(self, slot: int, lora_id: int, path: str) -> int:
        """Put a PEFT adapter into `slot` for sequences tagged `lora_id`; returns its rank."""
        if self.lora is None:
            raise ValueError("LoRA is disabled (lora.max_loras is 0)")
        with torch.inference_mode():
            return self.lora.load(slot, lora_id, path)

    def unload_lora(self, slot: int) -> None:
        if self.lora is not None:
            with torch.inference_mode():
                self.lora.unload(slot)

    @torch.inference_mode()
    def score(self, token_ids: list[int], lora_id: int = 0) -> torch.Tensor | None:
        """Full-vocabulary logits at every position of one prompt (rank 0; None elsewhere).

        For reference checks on an idle worker: it writes the prompt's KV into the first blocks.
        """
        assert self.runner is not None, "init_cache first"
        bs = self.config.cache.block_size
        blocks = list(range(-(-len(token_ids) // bs)))
        step = StepInput([SeqStep("score", list(token_ids), 0, blocks, sample=False, lora_slot=lora_id)])
        ids, positions, meta = self.runner.prepare(step)
        hidden = self.model(ids, positions, self.runner.kv_caches, meta)
        logits = self.model.compute_logits(hidden).float()
        return logits if self.rank == 0 else None

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
