"""What a worker decides for CUDA before touching it, tested without a GPU: settings that cannot run there are
refused with the field named (at build and in the worker), and decode CUDA graphs are skipped, with one log
line, for the models that cannot be captured (MoE: the expert counts are read on the host in every layer)."""

from __future__ import annotations

import logging

import pytest
import torch

from rayllm.attention.sdpa import SDPAAttention
from rayllm.executor.worker import Worker
from rayllm.layers.linear import TPGroup
from rayllm.models.registry import model_class
from rayllm.schema.config import EngineConfig, LlamaArch, ModelConfig, ParallelConfig, for_device
from rayllm.serve.builder import with_resolved_device
from rayllm.serve.config import ServerConfig

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
EXTRA = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2}, "qwen2_moe": MOE, "qwen3_moe": MOE}


def tiny_model(model_type: str) -> torch.nn.Module:
    arch = LlamaArch(16, 32, 2, 4, 2, 4, 64, 1e-6, 1e4, 64, False, model_type=model_type,
                     hf_config=tuple(sorted(EXTRA.get(model_type, {}).items())))
    return model_class(arch)(arch, TPGroup(), SDPAAttention())


def test_quantized_weights_are_refused_on_cuda():
    """The GGUF-quantized path is CPU code (int4pack, host tensors): on CUDA it crashed at start-up."""
    quantized = EngineConfig(model=ModelConfig(weights="quantized"))
    assert for_device(quantized, "cpu").parallel.device == "cpu"
    with pytest.raises(ValueError, match="model.weights: quantized runs on CPU only"):
        for_device(quantized, "cuda")
    # At build (the device resolved once for the app) ...
    served = ServerConfig.from_args({"engine": {"model": {"weights": "quantized"}, "parallel": {"device": "auto"}}})
    assert with_resolved_device(served, {"CPU": 4}).engine.parallel.device == "cpu"
    with pytest.raises(ValueError, match="model.weights"):
        with_resolved_device(served, {"CPU": 4, "GPU": 1})
    # ... and in a worker started on CUDA directly, before any CUDA call (none can run here).
    arch = LlamaArch(16, 32, 1, 4, 2, 4, 64, 1e-6, 1e4, 64, False)
    with pytest.raises(ValueError, match="model.weights"):
        Worker(EngineConfig(model=ModelConfig(weights="quantized"), parallel=ParallelConfig(device="cuda")),
               "unused", arch, 0, None)


def _worker(model: torch.nn.Module, **parallel) -> Worker:
    """A worker's decision state on a CUDA device (a torch.device object; nothing runs on it)."""
    worker = Worker.__new__(Worker)
    worker.device, worker.model = torch.device("cuda", 0), model
    worker.config = EngineConfig(parallel=ParallelConfig(device="cuda", **parallel))
    return worker


@pytest.mark.parametrize("model_type,want", [("llama", True), ("qwen3", True), ("mixtral", False),
                                             ("qwen2_moe", False), ("qwen3_moe", False)])
def test_cuda_graphs_are_skipped_for_moe_models(model_type, want, caplog):
    with caplog.at_level(logging.INFO, logger="rayllm.executor.worker"):
        assert _worker(tiny_model(model_type)).graphs_wanted() is want
    lines = [r.getMessage() for r in caplog.records if "CUDA graphs off" in r.getMessage()]
    assert len(lines) == (0 if want else 1)
    assert not _worker(tiny_model(model_type), cuda_graphs=False).graphs_wanted()


def test_cuda_graphs_stay_off_for_windowed_models_and_on_cpu():
    assert not _worker(tiny_model("gemma2")).graphs_wanted()  # soft-capped, windowed: host-built metadata
    cpu = _worker(tiny_model("llama"))
    cpu.device = torch.device("cpu")
    assert not cpu.graphs_wanted()
