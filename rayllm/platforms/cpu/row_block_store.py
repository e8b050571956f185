"""The batch-invariant oneDNN row blocks that onednn._probe_row_block found, kept on disk per machine.

The probe runs ~130 GEMMs per weight shape (SmolLM2's LM head and four layer shapes: ~1.1 s of CPU), and its
answer depends only on what decides oneDNN's kernel and blocking: the shape, dtype and thread count, torch (and
the oneDNN it bundles), the CPU (its model, features and cache sizes), oneDNN's environment and torch's fp32
matmul precision, and the probe's own code (onednn.py). All of these make the key of an answer, so a changed
input is a new key and a probe, never a stale answer. The file is a JSON object of key -> block in the CPU
kernels' cache directory (kernels.cache_dir); a missing, unreadable or damaged file means probing as before,
and a failed write is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from functools import cache
from pathlib import Path

import torch

FILE = "onednn_row_blocks.json"
MAX_ENTRIES = 256  # the oldest go first (entries of earlier torch versions, CPUs, thread counts)
_CPUINFO_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "cache size", "flags", "Features",
                   "CPU implementer", "CPU part")


def _path() -> Path:
    from rayllm.platforms.cpu.kernels import cache_dir

    return cache_dir() / FILE


@cache
def _machine() -> str:
    """The CPU as oneDNN sees it: /proc/cpuinfo's identity and feature lines (of the first CPU) and the cache
    sizes sysfs lists."""
    parts = [platform.machine()]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU's block
            name = line.split(":", 1)[0].strip()
            if name in _CPUINFO_FIELDS:
                parts.append(line.strip())
    except OSError:
        pass
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            parts.append(":".join((index / f).read_text().strip() for f in ("level", "type", "size")))
        except OSError:
            pass
    return "\n".join(parts)


@cache
def _source() -> str:
    return hashlib.sha256((Path(__file__).parent / "onednn.py").read_bytes()).hexdigest()


def key(shape: tuple[int, ...], dtype: torch.dtype, threads: int) -> str:
    mkldnn_matmul = getattr(torch.backends.mkldnn, "matmul", None)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("ONEDNN_", "DNNL_")))
    parts = (tuple(shape), str(dtype), threads, torch.__version__, torch.get_float32_matmul_precision(),
             str(getattr(mkldnn_matmul, "fp32_precision", "")), env, _machine(), _source())
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _read(path: Path) -> dict[str, int]:
    """The file's entries; none from a file that another user (root aside) owns or others may write."""
    try:
        with open(path) as f:
            st = os.fstat(f.fileno())
            if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
                return {}
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stored(shape: tuple[int, ...], dtype: torch.dtype, threads: int) -> int | None:
    """The block a probe found for this key on this machine, or None."""
    try:
        value = _read(_path()).get(key(shape, dtype, threads))
    except (OSError, RuntimeError):  # no cache directory this process may use
        return None
    return value if type(value) is int else None


def store(shape: tuple[int, ...], dtype: torch.dtype, threads: int, block: int) -> None:
    """Add a probe's answer (written to a temporary file renamed into place: readers see the old or the new file;
    of two processes writing at once, one's entry may be lost and is probed again next time)."""
    try:
        path = _path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key(shape, dtype, threads)] = block
        data = dict(list(data.items())[-MAX_ENTRIES:])
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".row-blocks-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, RuntimeError):  # a read-only or foreign cache directory: the next process probes again
        pass
