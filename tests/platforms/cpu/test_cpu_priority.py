"""lower_process_priority changes every thread's nice value (Linux keeps one per thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, threading
from rayllm.platforms.cpu.priority import lower_process_priority

base = os.getpriority(os.PRIO_PROCESS, 0)
stop = threading.Event()
early = threading.Thread(target=stop.wait, daemon=True)  # daemon: a failure below must not hang exit
early.start()  # a thread that exists before the call, as Ray's do in a replica
changed = lower_process_priority(5)
late = {}
t = threading.Thread(target=lambda: late.setdefault("nice", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
t.start(); t.join()


def nice_of(tid):
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except ProcessLookupError:  # a joined thread can linger in /proc/self/task for a moment
        return None


tasks = {int(tid): nice_of(int(tid)) for tid in os.listdir("/proc/self/task")}
tasks = {tid: nice for tid, nice in tasks.items() if nice is not None}
stop.set(); early.join()
print(json.dumps({"base": base, "changed": changed, "tasks": list(tasks.values()), "late": late["nice"]}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's")
def test_every_thread_and_later_threads_step_back():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, cwd=root, check=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    want = min(19, got["base"] + 5)
    assert got["changed"] >= 2  # the main thread and the early one
    assert got["tasks"] and all(n == want for n in got["tasks"]), got
    assert got["late"] == want  # inherited by threads started afterwards


def test_zero_changes_nothing():
    from rayllm.platforms.cpu.priority import lower_process_priority

    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert lower_process_priority(0) == 0
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
