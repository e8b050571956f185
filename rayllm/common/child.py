"""A helper child process: a fresh interpreter (`python -m <module> FD`) talking over a socket pair.

Not fork (the replica runs Ray's and torch's threads) nor multiprocessing's spawn (which re-runs the
parent's __main__ script, Ray's worker), as rayllm.engine.client.engine_process does for the engine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any


def start(module: str, init: Any, ready_timeout_s: float) -> tuple[subprocess.Popen, Connection]:
    """Starts `module`, sends it `init`, and waits for its "ready"; RuntimeError if it does not come."""
    parent_sock, child_sock = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", module, str(child_sock.fileno())], pass_fds=(child_sock.fileno(),))
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
    """The child's end (its command line names the descriptor)."""
    return Connection(int(sys.argv[1]))


def stop(proc: subprocess.Popen | None, conn: Connection | None) -> None:
    if proc is not None:
        proc.kill()
        proc.wait(5)
    if conn is not None:
        conn.close()
