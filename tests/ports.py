"""Ports for the servers that tests start."""

from __future__ import annotations

import contextlib
import fcntl
import random
import socket
import time
from pathlib import Path

# Ports handed out on this machine, across processes (pytest-xdist's workers, the two passes, the servers tests
# start): a `serve run` binds its port tens of seconds after the test chose it, and another process's bind check
# in that window would find the port free. Entries older than _HELD_S are forgotten.
_LEDGER = Path("/tmp") / "rayllm-test-ports"
_HELD_S = 900


def free_port() -> int:
    """A free port that nothing else here takes between this call and the server's bind: above Ray's worker
    ports (10002-19999), below Serve's direct-ingress ports (replicas bind from 30000 up, gRPC from 40000)
    and the kernel's ephemeral range, and never one handed out on this machine in the last _HELD_S seconds
    (a ledger file, locked while it is read and written)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    with open(_LEDGER, "a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        ledger.seek(0)
        now = time.time()
        given = {}
        for line in ledger.read().split():
            port, _, at = line.partition("@")
            with contextlib.suppress(ValueError):
                if now - float(at) < _HELD_S:
                    given[int(port)] = float(at)
        chosen = None
        for _ in range(200):
            port = rng.randrange(20000, max(min(low, 30000), 20001))
            if port in given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            chosen = port
            break
        if chosen is None:  # an unusual port range: let the kernel choose
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                chosen = s.getsockname()[1]
        given[chosen] = now
        ledger.seek(0)
        ledger.truncate()
        ledger.write(" ".join(f"{p}@{at:.0f}" for p, at in given.items()))
    return chosen


DIRECT_INGRESS_BLOCK = 16  # ports per Serve instance for its ingress replicas (HTTP; as many for gRPC)
_BLOCKS = 2000 // DIRECT_INGRESS_BLOCK  # within Serve's defaults' neighbourhood: 30000-31999, 40000-41999


def direct_ingress_env() -> dict[str, str]:
    """Port ranges of their own for one more Serve instance's ingress replicas. With direct ingress
    (serving.env) each instance's controller hands out 30000, 30001, ... without looking at the host, so two
    instances here at once both give their first replica 30000: one's replica cannot bind it and waits
    starting, while its HAProxy forwards to the other instance's replica (CI saw a launcher report ready,
    and drain nothing, for another instance's ingress). A counter in a locked file gives every instance
    started on this machine the next block, across processes (pytest-xdist's workers, the servers tests
    start as subprocesses)."""
    with open(Path("/tmp") / "rayllm-test-direct-ingress-block", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read().strip() or 0)
        f.seek(0)
        f.truncate()
        f.write(str(n + 1))
    low = DIRECT_INGRESS_BLOCK * (n % _BLOCKS)
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(30000 + low),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(30000 + low + DIRECT_INGRESS_BLOCK - 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(40000 + low),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(40000 + low + DIRECT_INGRESS_BLOCK - 1)}
