"""The image's working directory laid out here, so that its command runs as the container would run it: the
Dockerfile's COPY lines' files (but the package's install inputs: this checkout's installation, which the image
installs the same way, tests/deploy/test_deploy.py checks the install lines) and the RUN lines that render the
container's config. No Docker daemon here; tests/serve/test_stop_leaves_nothing.py runs the command.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL_INPUTS = {"pyproject.toml", "README.md", "constraints", "rayllm"}  # the package: PYTHONPATH instead


def network_address() -> str:
    """An IPv4 address of this machine's that is not loopback: where a published container port arrives."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("no network interface but loopback")


def image_workdir(dest: Path) -> None:
    """The Dockerfile's COPY lines (but the package's install inputs) and its RUN lines that write files."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^COPY (.*)$", dockerfile, re.M):
        *sources, target = [w for w in shlex.split(line) if not w.startswith("--")]
        for source in sources:
            if source in INSTALL_INPUTS:
                continue
            to = dest / target / Path(source).name if target.endswith("/") else dest / target
            to.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, to)
    for run in re.findall(r"^RUN (python .* > \S+)$", dockerfile, re.M):
        subprocess.run(["bash", "-c", run], cwd=dest, env=os.environ | {"PATH": path()}, check=True)


def path() -> str:
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this installation's
