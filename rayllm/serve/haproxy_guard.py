#!/usr/bin/env python3
"""Starts Ray Serve's HAProxy so that it dies with the process that started it.

Serve's HAProxyManager actor starts HAProxy and stops it in its own shutdown path. When that actor is
killed outright (`ray stop --force`, a SIGKILLed raylet, the OOM killer) nothing stops HAProxy: it is
re-parented to init and keeps port 8000, so the next `serve run` cannot bind. `serving_env()` points
RAY_SERVE_HAPROXY_BINARY_PATH here; this execs the real binary (RAYLLM_HAPROXY_BINARY, else `haproxy` on
PATH) with the same arguments under the same pid (Serve signals that pid for reloads), after detaching a
watcher that SIGKILLs it when the process that started it exits. PR_SET_PDEATHSIG is not used: it fires
when the starting *thread* exits, and Serve starts HAProxy from a thread that does not live as long.

Standard library only: Ray runs it as a plain executable.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys


def real_binary() -> str:
    path = os.environ.get("RAYLLM_HAPROXY_BINARY") or shutil.which("haproxy")
    if not path or os.path.realpath(path) == os.path.realpath(__file__):
        raise SystemExit("haproxy_guard: set RAYLLM_HAPROXY_BINARY to HAProxy or put haproxy on PATH")
    return path


def watch(parent_fd: int, haproxy_fd: int) -> None:
    """Block until the parent or HAProxy exits; if the parent went first, kill HAProxy."""
    readable, _, _ = select.select([parent_fd, haproxy_fd], [], [])
    if parent_fd in readable and haproxy_fd not in readable:
        signal.pidfd_send_signal(haproxy_fd, signal.SIGKILL)


def main(argv: list[str]) -> None:
    binary = real_binary()
    # pidfds, not pids: a pid reused after either process exits is never signalled.
    parent_fd, haproxy_fd = os.pidfd_open(os.getppid()), os.pidfd_open(os.getpid())
    if os.getppid() == 1:
        raise SystemExit("haproxy_guard: the parent exited before HAProxy started")
    if os.fork() == 0:  # double fork: the watcher is no child of HAProxy, which never waits for it
        if os.fork() == 0:
            os.setsid()  # out of the caller's process group and terminal: only the pidfds wake it
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            watch(parent_fd, haproxy_fd)
            os._exit(0)
        os._exit(0)
    os.wait()
    os.close(parent_fd)
    os.close(haproxy_fd)
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
