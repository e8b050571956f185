"""In the running server, the serving processes yield the CPU to the engine process (serving_nice)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow  # the real model or Ray Serve: `make test-fast` skips it


def _nice_by_cmdline() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            nice = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])
        except (OSError, ValueError, IndexError):
            continue
        out.setdefault(cmd, []).append(nice)
    return out


def _max_nice(procs: dict[str, list[int]], needle: str) -> int:
    found = [n for cmd, ns in procs.items() if needle in cmd for n in ns]
    assert found, f"no process with {needle!r} in its command line"
    return max(found)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads nice values from Linux's /proc")
def test_serving_processes_run_below_the_engine(server):
    procs = _nice_by_cmdline()
    engine = _max_nice(procs, "-m rayllm.engine.client.engine_process")
    for name in ("ingress", "tokenizer", "llm"):  # the model replica too: its engine runs in the child
        assert _max_nice(procs, f"ray::ServeReplica:llm:{name}") >= min(19, engine + 10), name
