"""Ports for the servers that tests start."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port that nothing else here takes between this call and the server's bind: above Ray's worker
    ports (10002-19999), below Serve's direct-ingress ports (replicas bind from 30000 up, gRPC from 40000)
    and the kernel's ephemeral range, and never one this process handed out before."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(min(low, 30000), 20001))
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # an unusual port range: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
