"""Engine configuration: a few frozen dataclasses, validated on creation and passed down."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rayllm.schema.field_checks import check_fields

log = logging.getLogger(__name__)

DTYPES = ("bfloat16", "float32", "float16")


@dataclass(frozen=True)
class ModelConfig:
    # A .gguf file, a Hugging Face directory, a Hugging Face id (org/name, org/name/file.gguf), an s3:// /
    # gs:// / abfs:// URI (rayllm/loader/model_sources.py), or None for the default model.
    model: str | None = None
    revision: str | None = None  # a Hugging Face id's branch, tag or commit (None: main)
    served_model_name: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"  # auto: bfloat16 (measured faster than fp32 on CPU and GPU alike)
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    # auto: weights are dense in `dtype`. quantized: a GGUF's Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 linear
    # weights stay quantized in memory and run quantized kernels at every batch size (rayllm/quant/
    # methods.py; CPU; 4-bit layers with int8 activations as parallel.cpu.small_batch_quant says); the embedding and
    # other tensors stay dense.
    weights: str = "auto"
    # fp8: every decoder linear layer's weight quantized to e4m3 at load (per output channel) and run by
    # FP8 GEMMs with per-token activation scales (rayllm/quant/fp8.py); CUDA with compute capability 8.9+
    # only, refused elsewhere. FP8 checkpoints take the same path on such GPUs when this is fp8.
    quantization: str | None = None
    # Embeddings (/v1/embeddings): pool the final-norm hidden state of the last token (decoder LLMs) or
    # the mean over all tokens.
    pooling: str = "last"  # last | mean

    def __post_init__(self) -> None:
        if self.pooling not in ("last", "mean"):
            raise ValueError(f"model.pooling must be last or mean, got {self.pooling!r}")
        if self.weights not in ("auto", "quantized"):
            raise ValueError(f"model.weights must be auto or quantized, got {self.weights!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or unset, got {self.quantization!r}")
        if self.quantization and self.weights == "quantized":
            raise ValueError("quantization: fp8 and weights: quantized (GGUF) exclude each other")
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES + ('auto',)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 16:
            raise ValueError(f"model.max_model_len must be >= 16 or null, got {self.max_model_len!r}")

    @property
    def torch_dtype_name(self) -> str:
        return "bfloat16" if self.dtype == "auto" else self.dtype


# `cache.block_size: auto` per device: what each platform's benchmarks were measured with (docs/benchmarks.md);
# on CUDA, xformers' split-k paged decode also wants 64 (docs/gpu.md).
AUTO_BLOCK_SIZE = {"cpu": 16, "cuda": 64}


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | str = "auto"  # tokens per KV block (a power of two), or auto: AUTO_BLOCK_SIZE per device
    # CPU: bytes of KV cache per rank. GPU: ignored in favour of gpu_memory_utilization.
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None  # tests use a tiny cache to force preemption

    def __post_init__(self) -> None:
        if self.block_size != "auto" and (not isinstance(self.block_size, int) or self.block_size < 1
                                          or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be auto or a power of two, got {self.block_size!r}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"cache.kv_cache_bytes must be positive, got {self.kv_cache_bytes!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"cache.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.num_blocks_override is not None and self.num_blocks_override < 2:
            raise ValueError(f"cache.num_blocks_override must be >= 2 or null, got {self.num_blocks_override!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # the per-step token budget that chunks long prefills
    # A sequence's logits do not depend on what shares its step (batch size, chunking, prefix cache):
    # one weight format per layer at every step size (no small-batch int4 copies) and oneDNN weights
    # laid out so that a row's GEMM result does not depend on the row count. Costs measured in
    # docs/benchmarks.md (CPU; bf16 or fp32 with prepacked weights).
    batch_invariant: bool = False
    # fcfs: arrival order (requests' priority is ignored); priority: lower `priority` first, aged by one
    # level per priority_aging_steps steps (the starvation bound: engine/wait_queue.py); a waiting request
    # may preempt a running one of strictly lower priority and later rank, and under memory pressure the
    # lowest-priority running request is preempted first.
    policy: str = "fcfs"
    priority_aging_steps: int = 1000
    # Priority policy: a step that computes a prompt leaves out the running sequences it outranks in both
    # priority and rank (their decodes wait one step), so an urgent request's first token does not wait for
    # a batch's decode rows (first token under a saturating batch: 3.0x idle against 4.95x without it in
    # docs/benchmarks.md). Only the priority policy reads it.
    prompt_steps_alone: bool = True
    # Per-tenant fair share: one API key's owner holds at most this share of max_num_seqs running slots
    # (at least one). 1.0 = no cap. Requests without a tenant (API keys off) are never capped.
    max_running_share: float = 1.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"scheduler.max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduler.policy must be fcfs or priority, got {self.policy!r}")
        if self.priority_aging_steps < 1:
            raise ValueError(f"scheduler.priority_aging_steps must be >= 1, got {self.priority_aging_steps!r}")
        if not 0.0 < self.max_running_share <= 1.0:
            raise ValueError(f"scheduler.max_running_share must be in (0, 1], got {self.max_running_share!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"scheduler.max_num_batched_tokens must be >= max_num_seqs (one decode token each), got "
                             f"{self.max_num_batched_tokens!r} < {self.max_num_seqs!r}")


# The projections of a decoder layer, by the last part of their module names (parallel.cpu.int8_one_pass_layers).
INT8_LAYER_TYPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class CpuConfig:
    """`parallel.cpu`: the settings only the CPU path reads (weights' CPU forms, threads, the all-reduce)."""

    # Layers whose GGUF weights were 4/8-bit also get int4/int8 copies for steps of few tokens (decode),
    # where they are faster than bf16. auto: 4-bit layers multiply int8-quantized activations (groups of
    # 32, as llama.cpp) with AVX-512 VNNI where the CPU has it, up to layers.linear.VNNI_TOKENS tokens;
    # weight_only: bf16 activations (torch's int4 kernel, up to 8 tokens; closer to bf16, slower); none:
    # bf16 weights only. scheduler.batch_invariant keeps auto's VNNI copies at every step size and drops the
    # others (docs/cpu.md). Quality and speed of each: docs/benchmarks.md.
    small_batch_quant: str = "auto"  # auto | weight_only | none
    # auto's int8 passes over each row: 2 (the row, then its quantization residual at 1/256 of its scale,
    # summed in one int32: bf16 activations' quality, measured in docs/cpu.md) or 1 (llama.cpp's Q8_1: faster
    # at 16+ rows, but its error changed the README's own answer, issue 35).
    int8_passes: int = 2
    # With int8_passes 2: the layer types (qkv_proj, o_proj, gate_up_proj, down_proj) that take one pass all
    # the same, where the second buys little quality for its time (measured per type in docs/cpu.md).
    int8_one_pass_layers: tuple[str, ...] = ()
    # Reorder bf16/fp32 weights once into oneDNN's blocked layout (platforms/cpu/onednn.py). Costs a
    # second copy of the linear weights in memory; off keeps plain F.linear.
    weight_prepack: bool = True
    # Threads each rank's torch uses; 0 = the CPUs this process may use (affinity, cgroup quota) over the ranks.
    threads_per_rank: int = 0
    # Threads for a step that runs a single sequence (one stream decoding alone) or at least
    # wide_step_tokens tokens (long prompts' prefill chunks), 0 = the same as threads_per_rank: such steps
    # gain from more threads, while a decode batch shares the cores with the serving processes and waits
    # for its slowest thread (docs/benchmarks.md).
    threads_single_sequence: int = 0
    # 0 = only single-sequence steps get threads_single_sequence; ignored with scheduler.batch_invariant.
    wide_step_tokens: int = 0
    # One rank on one torch thread: a step of at least this many tokens (a large decode batch) runs in two
    # halves of its sequences on two threads, each its own GEMMs, meeting once at the step's end
    # (platforms/cpu/split_step.py). 0 = off; ignored with scheduler.batch_invariant and TP > 1.
    half_step_tokens: int = 0
    # A step that runs on one torch thread and not in halves: its 4-bit int8 GEMMs (small_batch_quant auto)
    # split their output columns over this many threads, the caller's and a pool's that claim chunks one at
    # a time (platforms/cpu/csrc/pool.c), so the step never waits for a thread that a serving process holds.
    # 0 or 1 = the caller's thread only.
    qgemm_threads: int = 0
    # tensor_parallel_size > 1: the all-reduce of row-parallel outputs (rayllm/distributed/allreduce.py).
    # shm: a shared-memory segment every rank maps (platforms/cpu/csrc/shm_allreduce.c; ranks on one host);
    # gloo: TCP loopback; auto: shm when the ranks are on one host and it can be set up, else gloo. CUDA:
    # NCCL always.
    allreduce: str = "auto"

    def int8_passes_for(self, module_name: str) -> int:
        """The int8 passes of the layer `module_name` (e.g. layers.3.mlp.down_proj)."""
        return 1 if module_name.rpartition(".")[2] in self.int8_one_pass_layers else self.int8_passes

    def __post_init__(self) -> None:
        if self.small_batch_quant not in ("auto", "weight_only", "none"):
            raise ValueError(f"parallel.cpu.small_batch_quant must be auto, weight_only or none, got "
                             f"{self.small_batch_quant!r}")
        if self.int8_passes not in (1, 2):
            raise ValueError(f"parallel.cpu.int8_passes must be 1 or 2, got {self.int8_passes!r}")
        object.__setattr__(self, "int8_one_pass_layers", tuple(self.int8_one_pass_layers))  # a YAML list
        unknown = sorted(set(self.int8_one_pass_layers) - set(INT8_LAYER_TYPES))
        if unknown:
            raise ValueError(f"parallel.cpu.int8_one_pass_layers: unknown layer types {unknown} "
                             f"(choose from {', '.join(INT8_LAYER_TYPES)})")
        if self.allreduce == "deepspeed":
            raise ValueError("parallel.cpu.allreduce: deepspeed was replaced by shm, rayllm's own shared-memory "
                             "kernel (no extra to install)")
        if self.allreduce not in ("auto", "gloo", "shm"):
            raise ValueError(f"parallel.cpu.allreduce must be auto, gloo or shm, got {self.allreduce!r}")
        for name in ("threads_per_rank", "threads_single_sequence", "wide_step_tokens", "half_step_tokens",
                     "qgemm_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"parallel.cpu.{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    device: str = "auto"  # auto | cpu | cuda
    # auto: on CUDA triton (attention/triton.py) if it runs, else xformers, else SDPA; on CPU the C
    # paged-attention kernel (platforms/cpu/kernels.py) runs every sequence of a step, decode rows and prefill
    # chunks alike, and torch (SDPA per prefill chunk) runs only when the kernel does not build or the
    # model has sliding-window or soft-capped layers. sdpa: torch only. xformers, triton: CUDA only.
    attention_backend: str = "auto"
    # auto: TP=1 runs the model in the caller's process; "ray" always uses one actor per rank, which
    # keeps the model off the serving replica's GIL and event loop.
    executor: str = "auto"
    # CUDA: capture decode steps as CUDA graphs for a ladder of batch sizes (cuda_graphs.py). Ignored on CPU.
    cuda_graphs: bool = True
    # Graphs per captured batch size, each a run of layers: launching a graph costs the host time per
    # kernel while the GPU waits; in pieces the GPU starts on the first while the rest launch.
    cuda_graph_pieces: int = 8
    # What only the CPU reads (CpuConfig below); ignored on CUDA, with one log line when set.
    cpu: CpuConfig = field(default_factory=lambda: CpuConfig())

    def __post_init__(self) -> None:
        if isinstance(self.cpu, dict):
            object.__setattr__(self, "cpu", CpuConfig(**self.cpu))
        if self.executor not in ("auto", "ray"):
            raise ValueError(f"parallel.executor must be auto or ray, got {self.executor!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"parallel.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"parallel.device must be auto, cpu or cuda, got {self.device!r}")
        # The names themselves are attention.selector.BACKENDS' (checked there, and by the serve config).
        if not self.attention_backend.isidentifier():
            raise ValueError(f"parallel.attention_backend must be auto or a backend's name (sdpa, xformers, "
                             f"triton), got {self.attention_backend!r}")
        if not 1 <= self.cuda_graph_pieces <= 64:
            raise ValueError(f"parallel.cuda_graph_pieces must be between 1 and 64, got {self.cuda_graph_pieces!r}")


MAX_LORA_RANK = 64  # stacked adapter buffers are padded to max_lora_rank; the issue caps ranks at 64


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapter slots per replica; max_loras 0 keeps LoRA off (no buffers, no per-step work)."""

    max_loras: int = 0  # adapters resident at once (slot 0, the base model, is extra)
    max_lora_rank: int = 16  # every slot is padded to this rank: memory grows with it
    # name -> PEFT adapter directory, loaded when a replica starts (kept as sorted pairs: frozen + hashable).
    adapters: tuple[tuple[str, str], ...] = ()
    # Directories under which clients may name adapters (a request's lora_path, the load route); empty =
    # clients may name none (rayllm/serve/lora/adapter_paths.py). `adapters` above load whatever this says.
    allowed_roots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.adapters, dict):
            object.__setattr__(self, "adapters", tuple(sorted(self.adapters.items())))
        if isinstance(self.allowed_roots, (list, str)):
            roots = [self.allowed_roots] if isinstance(self.allowed_roots, str) else self.allowed_roots
            object.__setattr__(self, "allowed_roots", tuple(roots))
        if self.max_loras < 0:
            raise ValueError(f"lora.max_loras must be >= 0, got {self.max_loras!r}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"lora.max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank!r}")
        if self.adapters and len(self.adapters) > self.max_loras:
            raise ValueError(f"{len(self.adapters)} adapters configured but lora.max_loras is {self.max_loras}")
        for name, _ in self.adapters:
            if not name or ":" in name or "/" in name:
                raise ValueError(f"adapter name {name!r} must be non-empty, without ':' or '/'")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0


@dataclass(frozen=True)
class DebugConfig:
    """Fault injection for tests; everything off by default, never for production."""

    # The worker fails its step after this many steps (once) with torch.OutOfMemoryError: on CUDA from a real
    # allocation of twice the card, elsewhere raised. What an out-of-memory inside a step does to the step's
    # requests, shown on any device. None = off.
    fail_step_with_oom_after: int | None = None

    def __post_init__(self) -> None:
        if self.fail_step_with_oom_after is not None and self.fail_step_with_oom_after < 0:
            raise ValueError(f"debug.fail_step_with_oom_after must be >= 0 or null, got "
                             f"{self.fail_step_with_oom_after!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], section: str = "engine") -> EngineConfig:
        """Build from the nested mapping found in cluster.yaml (unknown keys are an error); every value is
        checked against its field's type first (errors name `section`.<section>.<field>)."""
        known = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
                 "lora": LoRAConfig, "debug": DebugConfig}
        if not isinstance(d, Mapping):
            raise ValueError(f"{section} must be a mapping of sections ({', '.join(known)}), got {d!r}")
        unknown = set(d) - set(known)
        if unknown:
            raise ValueError(f"unknown engine config sections: {sorted(unknown)}")
        d = {k: {} if v is None else v for k, v in d.items()}  # `cache:` with nothing under it: the defaults
        for k, v in d.items():
            if not isinstance(v, Mapping):
                raise ValueError(f"{section}.{k} must be a mapping, got {v!r}")
        d["parallel"] = _parallel_with_cpu(d)  # first: it takes the legacy CPU keys out of d's sections
        for k, v in d.items():
            check_fields(known[k], v, f"{section}.{k}.")
        return cls(**{k: known[k](**d.get(k, {})) for k in known})


def for_device(config: EngineConfig, device: str) -> EngineConfig:
    """The config on `device` (cpu or cuda, already decided): `parallel.device` set and every `auto`
    that depends on the device replaced (cache.block_size); refuses what cannot run there. Idempotent."""
    if device not in AUTO_BLOCK_SIZE:
        raise ValueError(f"device must be cpu or cuda here, got {device!r}")
    if device == "cuda" and config.model.weights == "quantized":  # its kernels and packed weights are CPU-only
        raise ValueError("model.weights: quantized runs on CPU only; on CUDA use weights: auto or quantization: fp8")
    cache, parallel = config.cache, config.parallel
    if cache.block_size == "auto":
        cache = replace(cache, block_size=AUTO_BLOCK_SIZE[device])
    if parallel.device != device:
        parallel = replace(parallel, device=device)
    if cache is config.cache and parallel is config.parallel:
        return config
    return replace(config, cache=cache, parallel=parallel)


def cpu_only_settings(config: EngineConfig) -> list[str]:
    """The CPU-only settings this config sets away from their defaults (ignored on CUDA)."""
    return ["engine.parallel.cpu"] if config.parallel.cpu != CpuConfig() else []


@dataclass(frozen=True)
class LlamaArch:
    """Shape of a Llama-family decoder, read from GGUF metadata or config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # Llama-3 style, as sorted items
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Which family builds the model (rayllm.models.registry), and the checkpoint's whole config as
    # sorted items (config.json, or its GGUF equivalent): family-specific fields are read from it with
    # `cfg()` in the family's own file, so this class stays the fields every family shares.
    model_type: str = "llama"
    hf_config: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def cfg(self, key: str, default: Any = None) -> Any:
        """A field of the checkpoint's config (None-valued fields count as missing)."""
        value = dict(self.hf_config).get(key)
        return default if value is None else value


# Before parallel.cpu existed these sat in model / parallel: accepted there still, with a warning.
LEGACY_CPU_KEYS = {("model", "small_batch_quant"): "small_batch_quant", ("model", "cpu_weight_prepack"): "weight_prepack",
                   ("parallel", "cpu_threads_per_rank"): "threads_per_rank",
                   ("parallel", "cpu_threads_single_sequence"): "threads_single_sequence",
                   ("parallel", "cpu_wide_step_tokens"): "wide_step_tokens",
                   ("parallel", "cpu_half_step_tokens"): "half_step_tokens", ("parallel", "cpu_allreduce"): "allreduce"}


def _parallel_with_cpu(d: dict[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The parallel section, with any legacy CPU keys of the model / parallel sections moved into `cpu`
    (taken out of `d`'s sections, which are replaced by copies, so the other sections see only theirs)."""
    moved: dict[str, Any] = {}
    for (section, key), new in LEGACY_CPU_KEYS.items():
        if key in d.get(section, {}):
            d[section] = dict(d[section])
            moved[new] = d[section].pop(key)
            log.warning("engine.%s.%s is now engine.parallel.cpu.%s", section, key, new)
    parallel = dict(d.get("parallel", {}))
    if "cpu" in parallel and parallel["cpu"] is None:  # as a section: `cpu:` with nothing under it
        del parallel["cpu"]
    if moved:
        cpu = parallel.get("cpu", {})
        parallel["cpu"] = moved | dict(cpu) if isinstance(cpu, Mapping) else cpu  # not a mapping: the check names it
    return parallel
