"""Which processes of this machine use a GPU, for tests/gpu/test_gpu_serving.py's placement check, read in
ways that hold in a container: from /proc (the GPU's device files a process holds open), and nvidia-smi's
per-process table parsed as it may come (in a container with its own PID namespace it names host PIDs, or
none, and `[N/A]` where the driver does not say).
"""

from __future__ import annotations

import os
import re
import subprocess

# A CUDA context holds the unified-memory device open; NVML (nvidia-smi, Ray's GPU detection) opens only
# nvidiactl and the GPUs' own files, so this one tells a context from a process that merely asked the driver.
CUDA_CONTEXT_FILE = "/dev/nvidia-uvm"


def open_device_files(pid: int, prefix: str = "/dev/nvidia") -> set[str]:
    """The files under `prefix` that process `pid` holds open (its /proc/PID/fd links); empty for a process
    that is gone."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(prefix):
            found.add(target)
    return found


def parse_compute_apps(csv: str) -> dict[int, tuple[str, int | None]]:
    """nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits -> pid ->
    (GPU uuid, MiB or None where it prints `[N/A]`, as under some containers and MIG)."""
    rows: dict[int, tuple[str, int | None]] = {}
    for line in csv.splitlines():
        if not line.strip():
            continue
        pid, uuid, mib = (x.strip() for x in line.split(","))
        rows[int(pid)] = (uuid, int(mib) if re.fullmatch(r"\d+", mib) else None)
    return rows


def compute_apps() -> dict[int, tuple[str, int | None]]:
    """The driver's table of processes holding GPU memory (nvidia-smi --query-compute-apps)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return parse_compute_apps(out)


def gpu_uuids() -> dict[str, str]:
    """nvidia-smi's index -> UUID of each GPU (the indices CUDA_VISIBLE_DEVICES names under Ray)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return dict((x.strip() for x in line.split(",")) for line in out.strip().splitlines())


def assigned_uuids(cuda_visible_devices: str, uuids: dict[str, str]) -> set[str]:
    """The UUIDs of the GPUs a CUDA_VISIBLE_DEVICES value names, by index or by UUID."""
    return {uuids.get(d.strip(), d.strip()) for d in cuda_visible_devices.split(",") if d.strip()}
