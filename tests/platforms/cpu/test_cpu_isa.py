"""CPUs without oneDNN's bf16 GEMMs (no AVX-512 BW/VL/DQ nor AVX-NE-CONVERT: AMD Zen 2/3, AVX2-only Intel,
Graviton2). This machine has AVX-512, so a child process emulates such a CPU with ONEDNN_MAX_CPU_ISA=AVX2
(read by oneDNN at process start); its engine starts with the default settings (dtype auto = bf16,
weight_prepack on), its logits match transformers' fp32 model, and batch-invariant mode is refused there
for bf16 with a message naming the setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rayllm.platforms.cpu.onednn import onednn_available
from tests.attention.tiny_models import ids, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = r"""
import json, sys, torch
from rayllm.executor.executor import make_executor
from rayllm.loader.loader import read_arch
from rayllm.platforms.cpu.onednn import onednn_available
from rayllm.platforms.cpu.platform import CpuPlatform
from rayllm.schema.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

path, prompt, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
cpu = torch.device("cpu")

def config(dtype, invariant=False):
    return EngineConfig(model=ModelConfig(model=path, dtype=dtype), cache=CacheConfig(kv_cache_bytes=8 << 20),
                        scheduler=SchedulerConfig(batch_invariant=invariant), parallel=ParallelConfig(device="cpu"))

got = {"bf16": onednn_available(cpu, torch.bfloat16), "fp32": onednn_available(cpu, torch.float32)}
ex = make_executor(config("auto"), path, read_arch(path))
try:
    torch.save(torch.as_tensor(ex.score(prompt, 0)).float(), out)
finally:
    ex.shutdown()
try:
    make_executor(config("auto", invariant=True), path, read_arch(path)).shutdown()
    got["refused"] = None
except ValueError as exc:
    got["refused"] = str(exc)
CpuPlatform(config("float32", invariant=True), cpu).setup_worker()  # fp32 keeps oneDNN: allowed
print(json.dumps(got))
"""


def test_this_machine_has_onednn_bf16():
    """The emulated test below is only meaningful where the real CPU takes the prepacked bf16 path."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this CPU has no oneDNN bf16 GEMMs itself")
    assert onednn_available(torch.device("cpu"), torch.bfloat16)


def test_engine_starts_on_a_cpu_without_onednn_bf16(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny(tmp_path / "model", "llama")
    prompt = ids(40, 1)
    out = tmp_path / "logits.pt"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(prompt), str(out)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bf16"] is False and got["fp32"] is True
    assert got["refused"] is not None and "scheduler.batch_invariant" in got["refused"]
    assert "model.dtype: float32" in got["refused"]

    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([prompt])).logits[0]
    logits = torch.load(out)
    assert logits.shape == want.shape
    # bf16 weights and activations against the fp32 model: within bf16's rounding, same greedy picks nearly always.
    assert (logits - want).abs().max() <= 0.05 * want.abs().max(), float((logits - want).abs().max())
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
