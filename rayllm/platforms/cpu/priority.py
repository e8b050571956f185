"""Serving processes step back for the engine when they share CPU cores with it.

On a CPU host the engine process does the work that tokens/s depends on, while the serving
processes (ingress, tokenizer, the model replica's event loop) wake for every request and every
streamed message; at equal priority the kernel lets them preempt the engine mid-step. Giving them
a higher nice value keeps their latency (they still run whenever a core is free) but hands the
engine the core when both want it (its effect: docs/benchmarks.md). Raising one's own nice value
needs no privilege, unlike lowering the engine's.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("ray.serve")


def lower_process_priority(by: int) -> int:
    """Add `by` to the nice value of every thread of this process; returns how many were changed.

    Linux keeps a nice value per thread (setpriority on a pid changes only that thread), so each
    task under /proc/self/task is changed; threads started later inherit from their creator.
    """
    if by <= 0:
        return 0
    task_dir = "/proc/self/task"
    if not os.path.isdir(task_dir):  # not Linux: the process-wide call is all there is
        os.nice(by)
        return 1
    changed = 0
    for name in os.listdir(task_dir):
        tid = int(name)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
            changed += 1
        except (ProcessLookupError, PermissionError):  # a thread that just exited
            continue
    log.info("serving process %d: nice +%d on %d threads", os.getpid(), by, changed)
    return changed
