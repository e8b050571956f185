"""CPU kernels in plain C (csrc/), compiled with the system C compiler on first use, called via ctypes.

Plain C with no torch headers builds in under a second (a torch C++ extension takes a minute), and
the calls pass raw data pointers, so each costs a few microseconds. Without a compiler, or if the
build fails, `load()` returns None and the engine keeps its torch path (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# -march=native: the library is built on the machine that runs it, and cached per source and CPU.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
KERNEL_DTYPES = frozenset(_SUFFIX)


def cache_dir() -> Path:
    return Path(os.environ.get("MODEL_PARALLEL_KERNEL_CACHE", Path.home() / ".cache" / "model_parallel_kernels"))


def _cpu_tag() -> str:
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:12]


def build(out_dir: Path | None = None, cflags: list[str] | None = None) -> Path:
    """Compile the kernels (or reuse a cached build) and return the shared library's path.
    `cflags` replaces CFLAGS (tests build the portable, non-AVX-512 fallback this way)."""
    cflags = cflags or CFLAGS
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join(cflags).encode()).hexdigest()[:16]
    if out_dir is None:
        out_dir = cache_dir()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home (some containers): build in the temp dir instead
            out_dir = Path(tempfile.gettempdir()) / "model_parallel_kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"paged_attention-{digest}-{_cpu_tag()}.so"
    if target.exists():
        return target
    # Build beside the target and rename: TP ranks may build at once, and rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building {SOURCE.name} failed: {exc.stderr.strip()[-2000:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x viewed as [T, H, D] with heads packed in each row: the tensor (copied only if its rows are
    not) and the stride between rows, in elements. Views into the fused qkv output need no copy."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x, x.stride(0)


class PagedKernels:
    """ctypes bindings; tensors on CPU, in bf16 (or fp32 for the paged-attention pair)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self._write: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self._attention: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in _SUFFIX.items():
            self._write[dtype] = _bind(lib, f"write_kv_{suffix}", [p, p, i64, p, p, p, i, i, i, i, i])
            self._attention[dtype] = _bind(lib, f"paged_attention_{suffix}",
                                           [p, i64, p, p, p, p, p, p, p, i, i, i, i, i, i, i, f, i])
        self._norm = _bind(lib, "add_rms_norm_bf16", [p, p, p, p, i, i, f, i])
        self._silu = _bind(lib, "silu_and_mul_bf16", [p, p, i, i])
        self._rotary = _bind(lib, "rotary_bf16", [p, i64, p, p, i, i, i])
        self._argmax = _bind(lib, "argmax_rows_bf16", [p, i64, i, i, p, i])
        lib.kernels_vectorized.restype = ctypes.c_int
        # AVX-512 BF16 build: the norm and SiLU kernels beat torch's from 1 to 1,024 tokens and are
        # level at 2,048; the scalar fallback loses from a few tokens, so then the model keeps torch's.
        self.vectorized = bool(lib.kernels_vectorized())

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k, v: [T, Hk, D] (rows may be strided); caches [Hk, num_blocks, block_size, D]; slots: [T] int64."""
        k, stride = _rows(k)
        v, v_stride = _rows(v)
        if v_stride != stride:
            k, v = k.contiguous(), v.contiguous()
            stride = k.stride(0)
        hk, nb, bs, d = k_cache.shape
        self._write[k_cache.dtype](k.data_ptr(), v.data_ptr(), stride, k_cache.data_ptr(), v_cache.data_ptr(),
                                   slots.data_ptr(), k.shape[0], hk, d, nb, bs)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, ctx_lens: torch.Tensor, q_starts: torch.Tensor | None = None,
                        q_lens: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        """Each sequence's query rows over its paged context, causal: q [T, Hq, D] (rows may be
        strided); per sequence (int32): block_tables [S, max_blocks], ctx_lens [S] (its context after
        this step), q_starts [S] (its first row in q) and q_lens [S]; without q_starts and q_lens,
        one row per sequence (decode); scale of q.k, D^-0.5 by default. Returns [T, Hq, D] contiguous."""
        q, q_stride = _rows(q)
        t, hq, d = q.shape
        hk, nb, bs, _ = k_cache.shape
        s = ctx_lens.shape[0]
        if q_lens is None:
            q_starts = torch.arange(s, dtype=torch.int32)
            q_lens = torch.ones(s, dtype=torch.int32)
        assert q_starts is not None
        out = torch.empty(t, hq, d, dtype=q.dtype)
        self._attention[k_cache.dtype](
            q.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            ctx_lens.data_ptr(), q_starts.data_ptr(), q_lens.data_ptr(), out.data_ptr(), s, hq, hk, d, nb, bs,
            block_tables.shape[1], d**-0.5 if scale is None else scale, torch.get_num_threads())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 [T, H]: (weight * rms_norm(x + residual), x + residual); the sum is written into
        `residual` in place (the caller's old residual is dead after the call)."""
        x = x.contiguous()
        t, h = x.shape
        has_residual = residual is not None
        res = residual.contiguous() if residual is not None else torch.empty_like(x)
        normed = torch.empty_like(x)
        self._norm(x.data_ptr(), res.data_ptr(), weight.data_ptr(), normed.data_ptr(), t, h, eps, int(has_residual))
        return normed, res

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [T, 2I] (gate | up) -> [T, I]."""
        x = x.contiguous()
        t, width = x.shape
        out = torch.empty(t, width // 2, dtype=x.dtype)
        self._silu(x.data_ptr(), out.data_ptr(), t, width // 2)
        return out

    def rotary_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first num_heads heads of each row of qkv ([T, width] bf16, contiguous) in place;
        cos, sin: contiguous fp32 with T rows of head_dim (RotaryEmbedding.tables)."""
        assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and head_dim <= 512
        self._rotary(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), qkv.shape[0], num_heads, head_dim)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Index of each row's largest value ([R, V] bf16 -> [R] int64), first on ties, as torch.argmax."""
        assert logits.dtype == torch.bfloat16 and logits.dim() == 2
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.long)
        self._argmax(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                     torch.get_num_threads())
        return out


def _bind(lib: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = None
    return fn


@cache
def load() -> PagedKernels | None:
    """The kernels, built once per process (and cached on disk); None if they cannot be built."""
    if os.environ.get("MODEL_PARALLEL_CPU_KERNELS", "1") == "0":
        return None
    try:
        return PagedKernels(build())
    except Exception as exc:  # no compiler, a read-only home, an unusual platform: keep the torch path
        log.warning("CPU paged-attention kernels unavailable (%s); using the torch path", exc)
        return None
