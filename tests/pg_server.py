"""A throwaway PostgreSQL server for tests: initdb into a temp dir, listen on a unix socket only.

Used when PostgreSQL's binaries are installed (on PATH, or Debian's /usr/lib/postgresql/<v>/bin);
otherwise callers skip, naming what is missing. PostgreSQL refuses to run as root, so as root the
server runs as the `postgres` user when it exists, else `nobody`.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tests.ports import free_port


def find_bin_dir() -> str | None:
    initdb = shutil.which("initdb")
    if initdb:
        return os.path.dirname(os.path.realpath(initdb))
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return os.path.dirname(found[-1]) if found else None


def _as_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return [shutil.which("runuser") or "/usr/sbin/runuser", "-u", name, "--"]
    raise RuntimeError("running as root and neither a `postgres` nor a `nobody` user exists")


@contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a postgresql:// URL to a fresh, empty server; stops it and deletes its files afterwards."""
    bindir = find_bin_dir()
    if bindir is None:
        raise FileNotFoundError("PostgreSQL is not installed (no initdb on PATH or in /usr/lib/postgresql/*/bin)")
    tmp = tempfile.mkdtemp(prefix="rayllm-pg-")
    os.chmod(tmp, 0o755)
    run_as = _as_user()
    if run_as:
        shutil.chown(tmp, user=run_as[2])
    data, port = os.path.join(tmp, "data"), free_port()
    pg_ctl = [*run_as, os.path.join(bindir, "pg_ctl"), "-D", data]
    try:
        subprocess.run([*run_as, os.path.join(bindir, "initdb"), "-D", data, "-A", "trust", "-U", "postgres",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True, cwd=tmp)
        subprocess.run([*pg_ctl, "-l", os.path.join(tmp, "log"), "-w", "-t", "60", "-o",
                        f"-p {port} -k {tmp} -c listen_addresses='' -c fsync=off", "start"],
                       check=True, capture_output=True, cwd=tmp)
        try:
            yield f"postgresql://postgres@/postgres?host={tmp}&port={port}"
        finally:
            subprocess.run([*pg_ctl, "-m", "immediate", "-w", "stop"], capture_output=True, cwd=tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
