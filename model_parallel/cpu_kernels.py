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


def build(out_dir: Path | None = None) -> Path:
    """Compile the kernels (or reuse a cached build) and return the shared library's path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    digest = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"paged_attention-{digest}-{_cpu_tag()}.so"
    if target.exists():
        return target
    # Build beside the target and rename: TP ranks may build at once, and rename is atomic.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building {SOURCE.name} failed: {exc.stderr.strip()[-2000:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class PagedKernels:
    """ctypes bindings; every tensor must be contiguous, on CPU, in bf16 or fp32."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._write: dict[torch.dtype, ctypes._CFuncPtr] = {}
        self._decode: dict[torch.dtype, ctypes._CFuncPtr] = {}
        for dtype, suffix in _SUFFIX.items():
            w = getattr(lib, f"write_kv_{suffix}")
            w.argtypes = [p, p, p, p, p, i, i, i, i, i]
            w.restype = None
            d = getattr(lib, f"decode_attention_{suffix}")
            d.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, i, f, i]
            d.restype = None
            self._write[dtype], self._decode[dtype] = w, d

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
        """k, v: [T, Hk, D]; caches [Hk, num_blocks, block_size, D]; slots: [T] int64 (negative: skip)."""
        k, v = k.contiguous(), v.contiguous()
        hk, nb, bs, d = k_cache.shape
        self._write[k_cache.dtype](k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                   slots.data_ptr(), k.shape[0], hk, d, nb, bs)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, D]; block_tables [B, max_blocks] int32; ctx_lens [B] int32. Returns [B, Hq, D]."""
        q = q.contiguous()
        b, hq, d = q.shape
        hk, nb, bs, _ = k_cache.shape
        out = torch.empty_like(q)
        self._decode[k_cache.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                                    ctx_lens.data_ptr(), out.data_ptr(), b, hq, hk, d, nb, bs,
                                    block_tables.shape[1], d**-0.5, torch.get_num_threads())
        return out


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
