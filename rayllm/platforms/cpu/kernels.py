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
import stat
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch

from rayllm.platforms.cpu.onednn_env import ONEDNN_CACHE_CAPACITY, onednn_cache_env  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("paged_attention.c", "qgemm.c", "pool.c",
                                                                    "shm_allreduce.c"))
# -march=native: the library is built on the machine that runs it, and cached per source and CPU.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
KERNEL_DTYPES = frozenset(_SUFFIX)


def cache_dir() -> Path:
    """RAYLLM_KERNEL_CACHE, else ~/.cache/rayllm_kernels; a process with no home directory (no HOME and no
    passwd entry: OpenShift's random UIDs) builds in its user's private temp dir instead."""
    if configured := os.environ.get("RAYLLM_KERNEL_CACHE"):
        return Path(configured)
    try:
        return Path.home() / ".cache" / "rayllm_kernels"
    except RuntimeError:  # Path.home() with neither HOME nor a passwd entry
        return private_temp_dir()


def private_temp_dir() -> Path:
    """gettempdir()/rayllm_kernels-<uid>, created with mode 0700. Refused when it exists but is not this
    user's private directory: a library another user planted under the expected name would run its
    constructor in this process when loaded."""
    path = Path(tempfile.gettempdir()) / f"rayllm_kernels-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{path} is not a private directory of this user (owner {st.st_uid}, mode "
                           f"{stat.S_IMODE(st.st_mode):o}); not building or loading kernels there")
    return path


def _check_owner(library: Path) -> None:
    """Load only a library this user (or root: `make install` may build it into an image) owns and no one
    else can write."""
    st = os.stat(library)
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
        raise RuntimeError(f"{library} belongs to user {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}, "
                           "not to this user alone: not loading it")


def _cpu_tag(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The machine and its CPU's feature list (x86's `flags` line, aarch64's `Features`): what -march=native
    builds for, and what the weight cache's packed forms depend on (loader/weight_cache.py)."""
    features = ""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                features = line
                break
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + features).encode()).hexdigest()[:12]


def build(out_dir: Path | None = None, cflags: list[str] | None = None) -> Path:
    """Compile the kernels (or reuse a cached build) and return the shared library's path.
    `cflags` replaces CFLAGS (tests build the portable, non-AVX-512 fallback this way)."""
    cflags = cflags or CFLAGS
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = b"".join(path.read_bytes() for path in SOURCES)
    digest = hashlib.sha256(src + " ".join(cflags).encode()).hexdigest()[:16]
    if out_dir is None:
        out_dir = cache_dir()
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # a read-only home (some containers): build in this user's private temp dir instead
            out_dir = private_temp_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"paged_attention-{digest}-{_cpu_tag()}.so"
    if target.exists():
        _check_owner(target)
        return target
    # Build beside the target and rename: TP ranks may build at once, and rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *cflags, "-o", tmp, *map(str, SOURCES), "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building the CPU kernels failed: {exc.stderr.strip()[-2000:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# The C kernels' return codes (csrc/paged_attention.c, KERNEL_*).
_ERRORS = {
    2: "a cache slot is outside the KV cache",
    3: "a block table entry is outside the KV cache",
    4: "a sequence's context length, query rows or block table width are inconsistent",
    5: "unsupported head dim",
}
_ROTARY_MAX_DIM = 512  # the rotary kernel's stack buffer (ROTARY_MAX_DIM)


def _check_code(code: int, kernel: str) -> None:
    if code == 0:
        return
    if code == 1:
        raise MemoryError(f"{kernel}: out of memory for its scratch buffers")
    raise ValueError(f"{kernel}: {_ERRORS.get(code, f'error {code}')}")


def _require(ok: bool, kernel: str, what: str | Callable[[], str]) -> None:
    """A real check at the boundary (not an assert: those vanish under -O, and C would read out of bounds).
    `what` may be a function, so a message with values is only formatted when the check fails."""
    if not ok:
        raise ValueError(f"{kernel}: {what if isinstance(what, str) else what()}")


_BF16, _I32, _I64 = torch.bfloat16, torch.int32, torch.int64  # module globals: cheaper than torch.<dtype>


def _cpu_1d(t: torch.Tensor, dtype: torch.dtype, n: int) -> bool:
    return t.dtype == dtype and t.dim() == 1 and t.shape[0] == n and t.is_contiguous() and t.is_cpu


def _cache_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (k_cache.dtype in KERNEL_DTYPES and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
            and v_cache.dtype == k_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.is_cpu and v_cache.is_cpu)


def _table_ok(x: torch.Tensor, rows: int, width: int) -> bool:
    return x.dtype == torch.float32 and x.numel() == rows * width and x.shape[0] == rows and x.is_contiguous()


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x viewed as [T, H, D] with heads packed in each row: the tensor (copied only if its rows are
    not) and the stride between rows, in elements. Views into the fused qkv output need no copy."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x, x.stride(0)


class StepArgs:
    """A step's per-sequence kernel inputs, checked once (PagedKernels.step_args) and read by every
    layer's kernel calls: at batch 1 the checks cost more than the attention itself. Holds the
    tensors, so their pointers stay valid."""

    __slots__ = ("tables", "ctx_lens", "q_starts", "q_lens", "slots", "num_seqs", "width", "ptrs", "slots_ptr")

    def __init__(self, tables: torch.Tensor, ctx_lens: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                 slots: torch.Tensor | None) -> None:
        self.tables, self.ctx_lens, self.q_starts, self.q_lens, self.slots = tables, ctx_lens, q_starts, q_lens, slots
        self.num_seqs, self.width = tables.shape
        self.ptrs = (tables.data_ptr(), ctx_lens.data_ptr(), q_starts.data_ptr(), q_lens.data_ptr())
        self.slots_ptr = slots.data_ptr() if slots is not None else 0


class PagedKernels:
    """ctypes bindings; tensors on CPU, in bf16 (or fp32 for the paged-attention pair)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self._write: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self._attention: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in _SUFFIX.items():
            self._write[dtype] = _bind(lib, f"write_kv_{suffix}", [p, p, i64, p, p, p, i, i, i, i, i], ctypes.c_int)
            self._attention[dtype] = _bind(lib, f"paged_attention_{suffix}",
                                           [p, i64, p, p, p, p, p, p, p, i, i, i, i, i, i, i, i, f, i], ctypes.c_int)
        self._norm = _bind(lib, "add_rms_norm_bf16", [p, p, p, p, i, i, f, i])
        self._silu = _bind(lib, "silu_and_mul_bf16", [p, p, i, i])
        self._rotary = _bind(lib, "rotary_bf16", [p, i64, p, p, i, i, i], ctypes.c_int)
        self._argmax = _bind(lib, "argmax_rows_bf16", [p, i64, i, i, p, i])
        lib.kernels_vectorized.restype = ctypes.c_int
        # AVX-512 BF16 build: the norm and SiLU kernels beat torch's from 1 to 1,024 tokens and are
        # level at 2,048; the scalar fallback loses from a few tokens, so then the model keeps torch's.
        self.vectorized = bool(lib.kernels_vectorized())
        # What the model's layers may hand these kernels: attention and cache writes in bf16 or fp32,
        # rotary in bf16, the norm and SiLU in bf16 when vectorized.
        self.attention_dtypes = KERNEL_DTYPES
        self.rotary_dtypes = frozenset({_BF16})
        self.fused_dtypes = frozenset({_BF16}) if self.vectorized else frozenset()

    def step_args(self, block_tables: torch.Tensor, ctx_lens: torch.Tensor, q_starts: torch.Tensor | None = None,
                  q_lens: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> StepArgs:
        """Check a step's sequence inputs once (shapes: paged_attention and write_kv); without
        q_starts and q_lens, one query row per sequence (decode)."""
        name = "paged_attention"
        s = ctx_lens.shape[0] if ctx_lens.dim() == 1 else -1
        _require(_cpu_1d(ctx_lens, _I32, s), name, "ctx_lens must be contiguous int32 [S]")
        _require(block_tables.dtype == _I32 and block_tables.dim() == 2 and block_tables.shape[0] == s
                 and block_tables.is_contiguous() and block_tables.is_cpu, name,
                 "block_tables must be contiguous int32 [S, max_blocks]")
        if q_lens is None:
            q_starts = torch.arange(s, dtype=_I32)
            q_lens = torch.ones(s, dtype=_I32)
        _require(q_starts is not None and _cpu_1d(q_starts, _I32, s) and _cpu_1d(q_lens, _I32, s), name,
                 "q_starts and q_lens must be contiguous int32 [S]")
        assert q_starts is not None  # for the type checker; checked just above
        if slots is not None:
            _require(_cpu_1d(slots, _I64, slots.shape[0] if slots.dim() == 1 else -1), "write_kv",
                     "slots must be contiguous int64 [T]")
        return StepArgs(block_tables, ctx_lens, q_starts, q_lens, slots)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor | StepArgs) -> None:
        """k, v: [T, Hk, D] (rows may be strided); caches [Hk, num_blocks, block_size, D]; slots: [T] int64
        (negative: skipped), or a step's StepArgs holding them. Raises ValueError on inputs the kernel
        cannot index safely."""
        if isinstance(slots, StepArgs):
            _require(slots.slots is not None, "write_kv", "the step's slots were not given to step_args")
            slots_ptr, n = slots.slots_ptr, slots.slots.shape[0]  # type: ignore[union-attr]
        else:
            _require(_cpu_1d(slots, _I64, k.shape[0]), "write_kv", "slots must be contiguous int64 [T]")
            slots_ptr, n = slots.data_ptr(), slots.shape[0]
        _require(_cache_ok(k_cache, v_cache), "write_kv", "caches must be matching contiguous CPU "
                 "[Hk, num_blocks, block_size, D] tensors in bf16 or fp32")
        hk, nb, bs, d = k_cache.shape
        _require(k.dim() == 3 and k.shape == v.shape and k.shape[0] == n and k.shape[1] == hk and k.shape[2] == d
                 and k.dtype == v.dtype == k_cache.dtype and k.is_cpu and v.is_cpu, "write_kv",
                 lambda: f"k and v must be [{n}, {hk}, {d}] {k_cache.dtype} on the CPU")
        k, stride = _rows(k)
        v, v_stride = _rows(v)
        if v_stride != stride:
            k, v = k.contiguous(), v.contiguous()
            stride = k.stride(0)
        _check_code(self._write[k_cache.dtype](k.data_ptr(), v.data_ptr(), stride, k_cache.data_ptr(),
                                               v_cache.data_ptr(), slots_ptr, n, hk, d, nb, bs), "write_kv")

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor | StepArgs, ctx_lens: torch.Tensor | None = None,
                        q_starts: torch.Tensor | None = None, q_lens: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
        """Each sequence's query rows over its paged context, causal: q [T, Hq, D] (rows may be
        strided); per sequence (int32): block_tables [S, max_blocks], ctx_lens [S] (its context after
        this step), q_starts [S] (its first row in q) and q_lens [S]; without q_starts and q_lens,
        one row per sequence (decode); or, in block_tables' place, a step's StepArgs holding them all.
        scale of q.k, D^-0.5 by default. Returns [T, Hq, D] contiguous.
        Raises ValueError on inputs the kernel cannot index safely (the per-sequence index checks run in C, O(sequences x blocks))."""
        name = "paged_attention"
        if isinstance(block_tables, StepArgs):
            step = block_tables
        else:
            _require(ctx_lens is not None, name, "ctx_lens is required with block tables")
            assert ctx_lens is not None  # for the type checker; checked just above
            step = self.step_args(block_tables, ctx_lens, q_starts, q_lens)
        _require(_cache_ok(k_cache, v_cache), name, "caches must be matching contiguous CPU "
                 "[Hk, num_blocks, block_size, D] tensors in bf16 or fp32")
        hk, nb, bs, d = k_cache.shape
        _require(q.dim() == 3 and q.shape[2] == d and q.shape[1] % hk == 0 and q.dtype == k_cache.dtype
                 and q.is_cpu, name, lambda: f"q must be [T, a multiple of {hk}, {d}] {k_cache.dtype} on the CPU")
        q, q_stride = _rows(q)
        t, hq, _ = q.shape
        out = torch.empty(t, hq, d, dtype=q.dtype)
        tables, lens, starts, qlens = step.ptrs
        _check_code(self._attention[k_cache.dtype](
            q.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(), tables, lens, starts, qlens,
            out.data_ptr(), t, step.num_seqs, hq, hk, d, nb, bs, step.width, d**-0.5 if scale is None else scale,
            torch.get_num_threads()), name)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 [T, H]: (weight * rms_norm(x + residual), x + residual); the sum is written into
        `residual` in place (the caller's old residual is dead after the call)."""
        _require(x.dim() == 2 and x.dtype == _BF16 and x.is_cpu, "add_rms_norm",
                 "x must be bf16 [T, H] on the CPU")
        t, h = x.shape
        _require(_cpu_1d(weight, _BF16, h) and (residual is None or (
            residual.shape == x.shape and residual.dtype == x.dtype and residual.is_cpu)),
            "add_rms_norm", lambda: f"weight must be contiguous bf16 [{h}] and residual bf16 {tuple(x.shape)}")
        x = x.contiguous()
        has_residual = residual is not None
        res = residual.contiguous() if residual is not None else torch.empty_like(x)
        normed = torch.empty_like(x)
        self._norm(x.data_ptr(), res.data_ptr(), weight.data_ptr(), normed.data_ptr(), t, h, eps, int(has_residual))
        return normed, res

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [T, 2I] (gate | up) -> [T, I]."""
        _require(x.dim() == 2 and x.shape[1] % 2 == 0 and x.dtype == _BF16 and x.is_cpu,
                 "silu_and_mul", "x must be bf16 [T, 2I] on the CPU")
        x = x.contiguous()
        t, width = x.shape
        out = torch.empty(t, width // 2, dtype=x.dtype)
        self._silu(x.data_ptr(), out.data_ptr(), t, width // 2)
        return out

    def rotary_(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first num_heads heads of each row of qkv ([T, width] bf16, contiguous) in place;
        cos, sin: contiguous fp32 with T rows of head_dim (RotaryEmbedding.tables)."""
        name = "rotary"
        _require(0 < head_dim <= _ROTARY_MAX_DIM and head_dim % 2 == 0, name,
                 lambda: f"head dim {head_dim} unsupported (even, at most {_ROTARY_MAX_DIM})")
        _require(qkv.dim() == 2 and qkv.dtype == _BF16 and qkv.is_contiguous() and qkv.is_cpu
                 and 0 <= num_heads * head_dim <= qkv.shape[1], name,
                 lambda: f"qkv must be contiguous bf16 [T, >= {num_heads} x {head_dim}] on the CPU")
        t = qkv.shape[0]
        _require(_table_ok(cos, t, head_dim) and _table_ok(sin, t, head_dim), name,
                 lambda: f"cos and sin must be contiguous fp32 with {t} rows of {head_dim}")
        _check_code(self._rotary(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), qkv.shape[0],
                                 num_heads, head_dim), name)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Index of each row's largest value ([R, V] bf16 -> [R] int64), first on ties, as torch.argmax."""
        _require(logits.dtype == _BF16 and logits.dim() == 2 and logits.shape[1] > 0
                 and logits.is_cpu, "argmax", "logits must be bf16 [R, V > 0] on the CPU")
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.long)
        self._argmax(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                     torch.get_num_threads())
        return out


def _bind(lib: ctypes.CDLL, name: str, argtypes: list, restype=None) -> ctypes._CFuncPtr:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
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
