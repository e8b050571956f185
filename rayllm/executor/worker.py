"""One tensor-parallel rank: process group, model shard, weights, KV cache, model runner.

Used in-process when tensor_parallel_size is 1 and as a Ray actor per rank otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from rayllm.attention.selector import make_attention_backend
from rayllm.common import startup_phases
from rayllm.common.errors import first_line
from rayllm.distributed.allreduce import make_all_reduce
from rayllm.layers.linear import TPGroup, release_unused_dense_weights
from rayllm.loader import weight_cache
from rayllm.loader.loader import load_weights
from rayllm.loader.weight_methods import choose_weight_methods
from rayllm.lora.layers import LoRAManager
from rayllm.models.registry import model_class
from rayllm.platforms.select import platform_for
from rayllm.runner import kv_cache
from rayllm.runner.cuda_graphs import DecodeGraphs, leave_capture_stream, model_capturable
from rayllm.runner.model_runner import ModelRunner
from rayllm.sample.logprobs import profile_one_slice
from rayllm.schema.config import EngineConfig, LlamaArch, for_device
from rayllm.schema.outputs import StepOutOfMemory
from rayllm.schema.step import SeqStep, StepInput, StepOutput

log = logging.getLogger(__name__)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def cuda_index(visible: str | None, assigned: Sequence[str | int]) -> int:
    """Index, among the devices this process can see, of the GPU Ray assigned it.

    Ray normally sets CUDA_VISIBLE_DEVICES to exactly the assigned ids, so this is 0; with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES the assigned id is found in the visible list (or is the
    physical index when every device is visible). Without a Ray assignment (a local engine, or the
    engine's child process, which inherits its replica's CUDA_VISIBLE_DEVICES): the first visible one.
    """
    if not assigned:
        return 0
    gpu = str(assigned[0])
    if not visible:
        return int(gpu)
    ids = [v.strip() for v in visible.split(",")]
    if gpu not in ids:
        raise RuntimeError(f"Ray assigned GPU {gpu} but CUDA_VISIBLE_DEVICES is {visible!r}")
    return ids.index(gpu)


def ray_gpu_ids() -> list[str]:
    """GPU ids Ray assigned this process ([] outside a Ray worker; Ray is not imported for this)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return []
    return [str(g) for g in ray.get_gpu_ids()]


def select_device(choice: str) -> torch.device:
    """The device of this process for a resolved `parallel.device` (the builder or make_executor
    resolves `auto` once, before any worker starts)."""
    if choice == "auto":
        raise ValueError("parallel.device must be resolved before a worker starts")
    if choice == "cuda":
        return torch.device("cuda", cuda_index(os.environ.get("CUDA_VISIBLE_DEVICES"), ray_gpu_ids()))
    return torch.device(choice)


class Worker:
    def __init__(self, config: EngineConfig, model_path: str, arch: LlamaArch, rank: int, dist_init: str | None):
        device = select_device(config.parallel.device)
        config = for_device(config, device.type)  # a worker built directly (tests) resolves its block size too
        self.config = config
        self.rank = rank
        world = config.parallel.tensor_parallel_size
        self.platform = platform_for(config, device)  # device-specific set-up and tuning (rayllm/platforms)
        self.platform.setup_worker()
        self.device = device
        self.dtype = getattr(torch, config.model.torch_dtype_name)
        self.tp = TPGroup()
        self.allreduce_backend = ""  # the TP all-reduce in use: nccl, gloo or shm (none at TP=1)
        if world > 1:
            dist.init_process_group(
                self.platform.dist_backend, init_method=dist_init, rank=rank, world_size=world, timeout=timedelta(minutes=10)
            )
            group = dist.group.WORLD
            self.allreduce_backend, reduce = make_all_reduce(
                config.parallel.cpu.allreduce, device, self.dtype, rank, world, group)
            self.tp = TPGroup(rank, world, group, reduce)
        self.attn_backend = make_attention_backend(config.parallel.attention_backend, device, arch.head_dim, self.dtype)
        torch.manual_seed(config.model.seed)
        # Parameters are created in the target dtype on the target device: no fp32 copy of the model
        # ever exists. Rotary tables are built in float64 and stored fp32 explicitly, so they stay fp32.
        with torch.device(device), default_dtype(self.dtype):
            self.model = model_class(arch)(arch, self.tp, self.attn_backend)
        cache = None  # a GGUF's dense weights and small-batch copies from an earlier start (loader/weight_cache.py)
        if config.model.weights == "quantized":
            from rayllm.loader.quantized import load_quantized_weights

            source_bits: dict[str, int] = {}  # no small-batch copies: the quantized kernels serve every size
            int8_activations = config.parallel.cpu.small_batch_quant == "auto" and self.platform.int8_activations()
            log.info("kept %d layers quantized", load_quantized_weights(self.model, model_path, int8_activations,
                                                                           config.parallel.cpu.int8_passes_for))
        else:
            cache = weight_cache.for_worker(config, model_path, arch, self.dtype, self.tp, self.platform)
            # A hit leaves nothing to pack: choose_weight_methods then only lays out oneDNN's weights.
            source_bits = ({} if cache is not None and cache.restore(self.model)
                           else load_weights(self.model, model_path, show_progress=rank == 0))
        choose_weight_methods(self.model, config, self.platform, self.dtype, source_bits)
        if cache is not None and not cache.hit:
            cache.save(self.model)
        # Batch-invariant mode's every-step copies leave their layers' dense weights unread (stored above first).
        released = release_unused_dense_weights(self.model)
        if released:
            log.info("released the dense weights of %d layers", released)
        invariant = config.scheduler.batch_invariant
        self.model.eval()
        self.arch = arch
        self.runner: ModelRunner | None = None
        self.steps = 0  # execute calls (debug.fail_step_with_oom_after counts them)
        self.lora = (LoRAManager(self.model, config.lora, self.dtype, device,
                                 batch_invariant=invariant and self.platform.prepacked_gemms(self.dtype))
                     if config.lora.enabled else None)

    def device_memory(self) -> tuple[str, int]:
        """This rank's GPU as the driver names it (nvidia-smi's `GPU-...` UUID; torch's omits the prefix) and
        the bytes torch's allocator holds on it; ("", 0) on CPU."""
        if self.device.type != "cuda":
            return "", 0
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), torch.cuda.memory_reserved(self.device)

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
            activations = self.profile_activation_bytes()
            budget = kv_cache.cuda_budget(cache.gpu_memory_utilization, self.device, activations)
            return kv_cache.blocks_for_budget(budget, per_block)
        return kv_cache.blocks_for_budget(cache.kv_cache_bytes, per_block)

    def _allocate(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        attn = self.model.layers[0].self_attn.qkv_proj
        return kv_cache.allocate(self.arch.num_layers, num_blocks, self.config.cache.block_size, attn.num_kv_heads,
                                 self.arch.head_dim, self.dtype, self.device, self.attn_backend.cache_layout)

    def _runner(self, caches) -> ModelRunner:
        return ModelRunner(self.model, caches, self.config.cache.block_size, self.arch.vocab_size, self.device,
                           self.rank == 0, lora=self.lora)

    @torch.inference_mode()
    def profile_activation_bytes(self) -> int:
        """CUDA: peak bytes that a forward of the largest step (max_num_batched_tokens tokens over
        max_num_seqs sequences, logits for each, then a slice of prompt logprobs) adds on top of what is
        resident, measured by running it.
        Every rank runs it at once (the executor asks them together), so the collectives match."""
        sched, bs = self.config.scheduler, self.config.cache.block_size
        step, num_blocks = kv_cache.profile_step(sched.max_num_batched_tokens, sched.max_num_seqs, bs)
        caches = self._allocate(num_blocks)
        runner = self._runner(caches)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        resident = torch.cuda.memory_allocated(self.device)
        hidden = runner.forward(step)
        self.model.compute_logits(hidden[: len(step.seqs)])
        profile_one_slice(hidden, self.arch.vocab_size, self.model.compute_logits)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - resident
        del caches, runner, hidden
        torch.cuda.empty_cache()
        return peak

    def graphs_wanted(self) -> bool:
        """Decode CUDA graphs on CUDA when configured, except for models whose windowed or soft-capped layers
        need host-built metadata per step (context slots, true lengths for window masks) that a graph's
        fixed-shape metadata lacks, and models with a layer that syncs with the host (MoE routing)."""
        if (self.device.type != "cuda" or not self.config.parallel.cuda_graphs
                or getattr(self.model, "torch_attention_only", False)):
            return False
        if not model_capturable(self.model):
            log.info("CUDA graphs off for %s: its MoE layers read expert token counts on the host; decode runs "
                     "eagerly", type(self.model).__name__)
            return False
        return True

    def init_cache(self, num_blocks: int) -> None:
        graphs = self.graphs_wanted()
        # With CUDA graphs one more block, owned by no sequence, takes the padding rows' writes.
        self.runner = self._runner(self._allocate(num_blocks + 1 if graphs else num_blocks))
        if half_step_tokens := self.platform.half_step_tokens():
            self.runner.enable_halves(half_step_tokens)
        if graphs:
            with startup_phases.phase("cuda_graphs"):
                self._capture_graphs(scratch_block=num_blocks)

    @torch.inference_mode()
    def _capture_graphs(self, scratch_block: int) -> None:
        assert self.runner is not None
        bs = self.config.cache.block_size
        max_len = self.config.model.max_model_len or self.arch.max_position_embeddings
        # Families with their own forward (no forward_pieces) are captured whole.
        pieces = min(self.config.parallel.cuda_graph_pieces, self.arch.num_layers) if hasattr(
            self.model, "forward_pieces") else 1
        graphs = DecodeGraphs(self.config.scheduler.max_num_seqs, -(-max_len // bs), bs, scratch_block,
                              self.runner.attn_builder, self.device, pieces=pieces)
        graphs.lora = self.lora  # adapter slots are a graph input (rayllm/lora/triton_kernels.py)
        # xformers may refuse paged decode during warm-up: its fallback copies from Python lists each
        # step, which a graph cannot replay.
        try:
            captured = graphs.capture(self.runner.model_forward, lambda: self.attn_backend.paged_decode,
                                      self.runner.model_forward_pieces)
        except Exception as exc:  # an op that cannot be captured here: serve eagerly rather than not at all
            log.warning("CUDA graph capture failed, decode runs eagerly: %s", exc)
            leave_capture_stream(self.device)
            torch.cuda.synchronize(self.device)
            return
        if captured:  # else DecodeGraphs said why not
            self.runner.graphs = graphs

    def execute(self, step: StepInput) -> StepOutput | None:
        assert self.runner is not None, "init_cache first"
        self.platform.before_step(step)
        self.steps += 1
        try:
            if self.steps - 1 == self.config.debug.fail_step_with_oom_after:
                if self.device.type == "cuda":  # a real allocation failure: twice the card, refused by the driver
                    total = torch.cuda.get_device_properties(self.device).total_memory
                    torch.empty(2 * total, dtype=torch.uint8, device=self.device)
                raise torch.OutOfMemoryError("injected by debug.fail_step_with_oom_after")
            return self.runner.execute(step)
        except torch.OutOfMemoryError as exc:
            message = first_line(exc)
        # Outside the handler the failed step's frames, and the tensors they held, are gone: give the cached
        # blocks back so that the next step finds the memory; the engine fails this step's requests only.
        self.platform.release_cached_memory()
        log.warning("out of memory in a step of %d sequences: %s", len(step.seqs), message)
        raise StepOutOfMemory(message)

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
        # Drop the weights and the KV cache now (the runner and its graphs reference each other, so they
        # would wait for a garbage collection): a process that builds another engine gets the memory back.
        if self.runner is not None:
            self.runner.close()
        self.runner = self.model = self.lora = None  # type: ignore[assignment]
        self.platform.release_cached_memory()
