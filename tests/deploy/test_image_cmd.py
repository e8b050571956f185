"""The image's command, run here as the container would run it: in a folder laid out as the Dockerfile's
WORKDIR (its COPY lines' files beside the package, and the RUN line that renders the container's config), with
nothing of serving.env in the environment. It serves the shipped app on every interface (a client reaches it at
this machine's network address, as `docker run -p` forwards there), with serving.env and the HAProxy guard's
paths applied, and its first SIGTERM (`docker stop`) lets an open stream finish, then exits 0.

No Docker daemon here: the package and the model come from this checkout's installation, which the image
installs the same way (tests/deploy/test_deploy.py checks the install lines); the port is a free one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from rayllm.serve.serving_env import serving_env
from tests.deploy.test_deploy import image_cmd
from tests.ports import free_port
from tests.serve.ops_apps import own_haproxy_env
from tests.serve.test_stop_leaves_nothing import _tree

pytestmark = pytest.mark.slow  # the real model on Ray Serve

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


class Stream(threading.Thread):
    """A chat completion streamed through the OpenAI SDK from `base_url`: `started` at its first chunk; then its
    token count and finish reason, or the error that ended it."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.started = threading.Event()
        self.tokens, self.finish, self.error = 0, None, None

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)
        try:
            for chunk in client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", stream=True, max_tokens=self.max_tokens, temperature=0,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}]):
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    self.tokens = chunk.usage.completion_tokens
                self.started.set()
        except Exception as exc:  # refused (nothing listens there) or cut (no graceful stop)
            self.error = exc
        self.started.set()


def path() -> str:
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # `python` is this installation's


def test_the_image_command_serves_on_every_interface_and_drains(tmp_path):
    image_workdir(tmp_path)
    cmd = image_cmd()
    config = tmp_path / next(w for w in reversed(shlex.split(cmd[-1])) if w.endswith(".yaml"))
    port = free_port()
    config.write_text(config.read_text().replace("port: 8000", f"port: {port}", 1))
    env = {k: v for k, v in os.environ.items() if k not in serving_env() and k != "RAY_ADDRESS"}
    env |= own_haproxy_env() | {"PATH": path(), "PYTHONPATH": str(ROOT), "RAYLLM_RAY_DASHBOARD": "0"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=open(tmp_path / "serve.out", "wb"),
                            stderr=open(log, "wb"), start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 400
        while "rayllm: ready in " not in log.read_text(errors="replace"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        # serving.env and the guard's paths, in the process that `exec` made of the command's shell
        launched = psutil.Process(proc.pid).environ()
        assert {k: launched.get(k) for k in serving_env()} == serving_env()
        tree = _tree(proc.pid)
        assert any(p.name() == "haproxy" for p in tree)  # RAY_SERVE_ENABLE_HA_PROXY=1, from serving.env

        stream = Stream(f"http://{network_address()}:{port}/v1", max_tokens=64)
        stream.start()
        assert stream.started.wait(60) and stream.error is None, stream.error
        proc.send_signal(signal.SIGTERM)  # docker stop
        stream.join(120)
        assert (stream.error, stream.finish, stream.tokens) == (None, "length", 64), log.read_text()[-2000:]
        assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
        assert "rayllm: SIGTERM: stopping" in log.read_text()
    finally:
        for p in [*tree, *_tree(proc.pid)]:  # whatever a failure left
            if p.is_running():
                p.kill()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
