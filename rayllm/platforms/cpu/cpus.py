"""How many CPUs this process may really use: its affinity mask (taskset, a pod's cpuset), capped by its
cgroup's CPU quota (a pod's `limits.cpu`). os.cpu_count() counts the node's cores: a pod pinned to 4 CPUs
on a 64-core node would start 64 torch threads, which then take turns on 4 cores."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMBERSHIP = Path("/proc/self/cgroup")


def usable_cpus(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> int:
    """The affinity mask's CPU count, capped by the tightest CPU quota of this process's cgroup and its
    ancestors (rounded down: threads beyond the quota are throttled, and a step waits for its slowest)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota(root, membership)
    return max(1, min(cpus, int(quota))) if quota is not None else cpus


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, membership: Path = MEMBERSHIP) -> float | None:
    """CPUs' worth of quota (v2 cpu.max; v1 cpu.cfs_quota_us / cpu.cfs_period_us), None when unlimited."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2's unified hierarchy
            limits += [q for d in _up(root, path) if (q := _v2_quota(d)) is not None]
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu,cpuacct (and often linked as cpu)
            for base in (root / controllers, root / "cpu"):
                limits += [q for d in _up(base, path) if (q := _v1_quota(d)) is not None]
    return min(limits, default=None)


def _up(base: Path, path: str) -> Iterator[Path]:
    """The cgroup's directory and each ancestor's, up to the mount's root. Inside a container without a
    cgroup namespace the path is the host's and only the root exists (it is the container's cgroup)."""
    parts = [p for p in path.split("/") if p]
    for n in range(len(parts), -1, -1):
        yield base.joinpath(*parts[:n])


def _v2_quota(d: Path) -> float | None:
    try:
        quota, period = (d / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        return quota / int((d / "cpu.cfs_period_us").read_text()) if quota > 0 else None
    except (OSError, ValueError, ZeroDivisionError):
        return None
