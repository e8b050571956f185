"""A helper child process: a fresh interpreter (`python -m <module> FD`) talking over a socket pair.

Not fork (the replica runs Ray's and torch's threads) nor multiprocessing's spawn (which re-runs the
parent's __main__ script, Ray's worker), as rayllm.engine.client.engine_process does for the engine.
On Linux the child dies with its parent (a SIGKILL from the kernel): a runaway render or compile never reads
the socket's end, and nothing here outlives the replica that asked for it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

# A call's limit is CPU time the child spends on it: on a loaded machine (a 2-core CI box, a replica's
# busy neighbours) a request's wall time is not its own. The wall clock still bounds the wait, at this
# multiple of the limit, so a child stopped by the scheduler cannot stall its caller either.
WALL_FACTOR = 4.0
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15 of stat)


def start(module: str, init: Any, ready_timeout_s: float) -> tuple[subprocess.Popen, Connection]:
    """Starts `module`, sends it `init`, and waits for its "ready"; RuntimeError if it does not come."""
    parent_sock, child_sock = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", module, str(child_sock.fileno()), str(os.getpid())],
                            pass_fds=(child_sock.fileno(),))
    child_sock.close()
    conn = Connection(os.dup(parent_sock.fileno()))
    parent_sock.close()
    try:
        conn.send(init)
        if not conn.poll(ready_timeout_s) or conn.recv() != "ready":
            raise RuntimeError(f"{module} did not start")
    except (EOFError, OSError, RuntimeError):
        stop(proc, conn)
        raise RuntimeError(f"{module} did not start") from None
    return proc, conn


def connect() -> Connection:
    """The child's end (its command line names the descriptor, then the parent's pid)."""
    if len(sys.argv) > 2:
        _die_with_parent(int(sys.argv[2]))
    return Connection(int(sys.argv[1]))


def _die_with_parent(parent: int) -> None:
    """Asks the kernel for a SIGKILL when the parent goes (Linux's PR_SET_PDEATHSIG; it fires when the thread that
    started this child ends: ChildWorker starts it from the pool threads that call it, which live as long as the
    replica)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent went before the request took effect: no signal will come
        os._exit(1)


def stop(proc: subprocess.Popen | None, conn: Connection | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait(5)
    if conn is not None:
        conn.close()


class ChildBusy(Exception):
    """Other requests held the child past this one's wall cap (WALL_FACTOR times its limit)."""


class ChildTimeout(Exception):
    """The child did not answer within the time limit; it was stopped (the next call starts a fresh one)."""


class ChildDied(Exception):
    """The child died while it worked (a memory limit, a crash); the next call starts a fresh one."""


class ChildWorker:
    """One helper child process that serves one request at a time, started on first use and again after it
    was stopped: a request that runs past its time limit stops the child, the only way to interrupt
    native code (xgrammar's compiler, a runaway template). Callers wait their turn within their own limit."""

    def __init__(self, module: str, init: Any, start_timeout_s: float):
        self.module, self.init, self.start_timeout_s = module, init, start_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    def _started(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn
        self.close()
        self._proc, self._conn = start(self.module, self.init, self.start_timeout_s)
        return self._conn

    def close(self) -> None:
        stop(self._proc, self._conn)
        self._proc = self._conn = None

    def call(self, request: Any, timeout_s: float) -> Any:
        """The child's reply to `request` within `timeout_s` of the child's CPU time (and WALL_FACTOR times
        that of wall time); ChildBusy, ChildTimeout or ChildDied as above, RuntimeError if the child does not
        start."""
        # The turn is awaited up to the wall cap: a request queued behind another on a loaded machine is not
        # refused for that machine's load.
        if not self._lock.acquire(timeout=WALL_FACTOR * timeout_s):
            raise ChildBusy()
        try:
            conn = self._started()
            assert self._proc is not None
            cpu_start = cpu_seconds(self._proc.pid)
            conn.send(request)
            if not self._answered(conn, self._proc.pid, cpu_start, timeout_s):
                self.close()
                raise ChildTimeout()
            try:
                return conn.recv()
            except (EOFError, OSError):
                self.close()
                raise ChildDied() from None
        finally:
            self._lock.release()

    @staticmethod
    def _answered(conn: Connection, pid: int, cpu_start: float | None, timeout_s: float) -> bool:
        """Whether the reply came before the child spent `timeout_s` of CPU on it (or the wall cap passed)."""
        deadline = time.monotonic() + WALL_FACTOR * timeout_s
        wait = timeout_s
        while not conn.poll(wait):
            used = cpu_seconds(pid)
            left_wall = deadline - time.monotonic()
            if cpu_start is None or used is None or left_wall <= 0:
                return conn.poll(0)
            left_cpu = timeout_s - (used - cpu_start)
            if left_cpu <= 0:
                return False
            wait = min(left_cpu, left_wall)  # it cannot burn its CPU left any faster than the wall clock
        return True
