"""tests/ports.py: ports handed out to the servers tests start are never handed out twice on this machine while
they may still be waiting for their server's bind, whichever process asks (pytest-xdist's workers, both passes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each process draws the same candidate ports (one seed), and binds none of them: only the ledger tells
# the second process that the first one's ports are taken.
DRAW = """
import random, sys
sys.path.insert(0, sys.argv[1])
seeded = random.Random
random.Random = lambda: seeded(0)
from tests.ports import free_port
print(" ".join(str(free_port()) for _ in range(5)))
"""


def test_two_processes_drawing_the_same_candidates_get_different_ports():
    def draw() -> list[int]:
        out = subprocess.run([sys.executable, "-c", DRAW, str(ROOT)], capture_output=True, text=True, timeout=60,
                             check=True)
        return [int(p) for p in out.stdout.split()]

    first, second = draw(), draw()
    assert len(set(first)) == len(first) == 5 and len(set(second)) == 5
    assert not set(first) & set(second), (first, second)
