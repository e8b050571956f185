"""rayllm.common.child: a call's limit is the child's CPU time, with the wall clock capped at a multiple.

The child here is a real `python -m` process (written to tmp_path) that sleeps or spins on request:
sleeping stands for a child the machine's scheduler holds back (it spends no CPU), spinning for a
runaway render or compile.
"""

from __future__ import annotations

import os
import time

import pytest

from rayllm.common import child

CHILD = '''
import os
import time
from rayllm.common import child

conn = child.connect()
conn.recv()
conn.send("ready")
while True:
    kind, seconds = conn.recv()
    if kind == "sleep":
        time.sleep(seconds)
    else:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass
    conn.send((kind, seconds))
'''


@pytest.fixture
def worker(tmp_path, monkeypatch):
    (tmp_path / "spin_child.py").write_text(CHILD)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    w = child.ChildWorker("spin_child", None, 60.0)
    yield w
    w.close()


def test_a_child_held_back_by_the_machine_is_waited_for(worker):
    # 1.5 s of wall time, almost no CPU: within a 1 s CPU limit (the wall cap is 4 s).
    assert worker.call(("sleep", 1.5), 1.0) == ("sleep", 1.5)


def test_a_child_spending_its_cpu_limit_is_stopped(worker):
    worker.call(("sleep", 0), 1.0)  # started
    pid = worker._proc.pid
    t0 = time.monotonic()
    with pytest.raises(child.ChildTimeout):
        worker.call(("spin", 30.0), 1.0)
    assert time.monotonic() - t0 < child.WALL_FACTOR * 1.0 + 1.0
    assert child.cpu_seconds(pid) is None  # stopped and reaped
    assert worker.call(("spin", 0.1), 1.0) == ("spin", 0.1)  # a fresh child answers the next call


def test_the_wall_clock_caps_a_child_that_never_runs(worker):
    t0 = time.monotonic()
    with pytest.raises(child.ChildTimeout):
        worker.call(("sleep", 30.0), 0.5)
    elapsed = time.monotonic() - t0
    assert child.WALL_FACTOR * 0.5 - 0.1 <= elapsed < child.WALL_FACTOR * 0.5 + 2.0


def test_cpu_seconds_counts_the_process_own_time():
    start = child.cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert child.cpu_seconds(os.getpid()) - start >= 0.25


def test_a_caller_queued_behind_a_held_back_one_gets_its_turn(worker):
    import threading

    worker.call(("sleep", 0), 1.0)  # started
    first = threading.Thread(target=worker.call, args=(("sleep", 1.5), 1.0))
    first.start()
    time.sleep(0.2)
    # Waits ~1.3 s for its turn (past its own 1 s limit, within the wall cap), then answers.
    assert worker.call(("spin", 0.1), 1.0) == ("spin", 0.1)
    first.join()
