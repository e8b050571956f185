"""Decode CUDA graphs: which models can be captured, and what a failed capture leaves behind.

- MoE layers read each expert's token count on the host (torch.bincount sizes its output from the data),
  which a graph cannot capture: `model_capturable` says so for the MoE families and for no dense one, and
  FakeTensorMode on a fake CUDA device (torch's own check for ops whose output depends on device data)
  agrees layer by layer.
- The torch attention path is not captured: its decode gathers each row's whole (fixed) table width.
- A failed capture must not leave the thread on the capture stream: torch.cuda.graph's real __exit__ is
  run, with CUDA itself (streams, the graph's capture_begin/capture_end) mocked, since no GPU is here.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from rayllm.attention.base import AttentionMetadataBuilder
from rayllm.attention.sdpa import SDPAAttention
from rayllm.layers.linear import TPGroup
from rayllm.models.registry import model_class
from rayllm.runner.cuda_graphs import DecodeGraphs, model_capturable
from rayllm.runner.model_runner import ModelRunner
from rayllm.schema.config import LlamaArch
from rayllm.schema.step import SeqStep, StepInput

MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 8}
FAMILIES = {
    "llama": {}, "qwen2": {}, "qwen3": {}, "gemma2": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": MOE | {"num_experts": 4, "shared_expert_intermediate_size": 8},
    "qwen3_moe": MOE | {"num_experts": 4},
}


def tiny_model(model_type: str, device: str = "cpu") -> torch.nn.Module:
    arch = LlamaArch(16, 32, 2, 4, 2, 4, 64, 1e-6, 1e4, 64, False, model_type=model_type,
                     hf_config=tuple(sorted(FAMILIES[model_type].items())))
    with torch.device(device):
        return model_class(arch)(arch, TPGroup(), SDPAAttention())


def mlps_run_without_device_data(model_type: str) -> bool:
    """Whether every layer's MLP runs on fake CUDA tensors: FakeTensorMode refuses an op whose output shape
    or value must be read from the device (what a graph capture cannot do)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = tiny_model(model_type, "cuda")
        try:
            for layer in model.layers:
                layer.mlp(torch.empty(3, 16, device="cuda"))
        except (torch._subclasses.fake_tensor.DynamicOutputShapeException,
                torch._subclasses.fake_tensor.DataDependentOutputException):
            return False
    return True


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_moe_families_are_not_capturable(model_type):
    capturable = model_capturable(tiny_model(model_type))
    assert capturable == ("moe" not in model_type and model_type != "mixtral")
    assert capturable == mlps_run_without_device_data(model_type)


class FakeCuda:
    """CUDA's stream state and graph capture, mocked (no GPU here): one current stream per thread, a
    capture that an op reading device data on the host invalidates, and capture_end raising then, as
    cudaStreamEndCapture does."""

    def __init__(self) -> None:
        self.default = self.Stream()
        self.current = self.default
        self.capturing = False
        fake = self

        class Graph:
            def capture_begin(self, *pool, **kwargs) -> None:
                fake.capturing = True

            def capture_end(self) -> None:
                fake.capturing = False
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        class StreamContext:
            def __init__(self, stream) -> None:
                self.stream, self.previous = stream, None

            def __enter__(self) -> None:
                self.previous, fake.current = fake.current, self.stream

            def __exit__(self, *args) -> None:
                fake.current = self.previous

        self.Graph, self.StreamContext = Graph, StreamContext

    class Stream:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, other) -> None:
            pass

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Stream", self.Stream)
        monkeypatch.setattr(cuda, "stream", self.StreamContext)
        monkeypatch.setattr(cuda, "current_stream", lambda *a: self.current)
        monkeypatch.setattr(cuda, "default_stream", lambda *a: self.default)
        monkeypatch.setattr(cuda, "set_stream", lambda s: setattr(self, "current", s))
        monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: None)
        monkeypatch.setattr(cuda, "CUDAGraph", self.Graph)
        monkeypatch.setattr(cuda.graph, "default_capture_stream", None)


def test_a_failed_capture_leaves_the_default_stream(monkeypatch):
    """The MoE case before the flag: the forward syncs with the host, which fails under capture; the
    real torch.cuda.graph.__exit__ then raises from capture_end before leaving the capture stream."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    caches = [(torch.zeros(2, 5, 4, 4), torch.zeros(2, 5, 4, 4))]
    builder = AttentionMetadataBuilder(4, caches, seq_tables=True)  # a kernel backend's (Triton, xformers)
    graphs = DecodeGraphs(2, 2, 4, 4, builder, torch.device("cpu"))
    graphs.capture_enabled = True  # what a CUDA device sets (the buffers stay on the CPU here)

    def forward(ids, positions, meta):
        if fake.capturing:  # .tolist() under capture: cudaErrorStreamCaptureUnsupported
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return torch.zeros(ids.shape[0], 16)

    with pytest.raises(RuntimeError, match="capture"):
        graphs.capture(forward)
    assert fake.current is fake.default and not fake.capturing


def test_the_torch_path_is_not_captured_and_gathers_only_the_longest_context(caplog):
    """The torch decode path (SDPA without kernels, a CUDA fallback) gathers each row's blocks. In a graph
    its tables are max_model_len wide (131k tokens here: [Hk, 256, 131072, D] per layer), so it is not
    captured; eagerly it gathers up to the step's longest context."""
    hk, bs, width, blocks = 2, 64, 2048, 40
    caches = [(torch.zeros(hk, blocks + 1, bs, 4), torch.zeros(hk, blocks + 1, bs, 4))]
    runner = ModelRunner(tiny_model("llama"), caches, bs, 64, torch.device("cpu"), True)
    graphs = DecodeGraphs(256, width, bs, blocks, runner.attn_builder, torch.device("cpu"))
    assert graphs.metadata(256).decode_gather_index.numel() == hk * 256 * width  # what a graph would gather
    graphs.capture_enabled = True  # what a CUDA device sets: refused before any CUDA call
    with caplog.at_level("WARNING", logger="rayllm.runner.cuda_graphs"):
        assert graphs.capture(lambda *a: pytest.fail("warmed up")) is False
    assert "131072-token table width" in caplog.text
    step = StepInput([SeqStep("a", [1], 4, [0], sample=True), SeqStep("b", [2], 129, [1, 2, 3], sample=True)])
    assert graphs.run(step.seqs) is None  # the runner's eager path
    _, _, meta = runner.prepare(step)
    assert meta.decode_gather_index.numel() == hk * 2 * 3  # the longest context's 3 blocks per row
