"""The install paths: `make -n` (dry run: prints the recipe, runs nothing) in a temporary copy of the
Makefile, pyproject.toml and constraints/, with the venv's marker files simulated by `touch`."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "constraints", tmp_path / "constraints")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    (tmp_path / ".venv" / "bin" / "uv").touch()  # a venv this Makefile made has its installer
    return tmp_path


def _touch_after_sources(path: Path) -> None:
    """A marker written by an earlier install: newer than every file it depends on."""
    later = time.time() + 5
    path.touch()
    os.utime(path, (later, later))


def _dry_run(tree: Path, *args: str) -> str:
    # Without the caller's make variables (`PYTEST_ARGS=... make test` runs this test too).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ARGS", "UNIT_LANES", "MAKEFLAGS")}
    return subprocess.run(["make", "-n", *args], cwd=tree, env=env, capture_output=True, text=True, check=True).stdout


def test_serve_after_a_gpu_install_keeps_the_gpu_torch(tree):
    _touch_after_sources(tree / ".venv" / ".installed-gpu")
    out = _dry_run(tree, "serve")
    assert "pip install" not in out and "constraints/cpu.txt" not in out
    assert "serve run cluster.yaml" in out
    # The test extras go in on the GPU pins too.
    test_out = _dry_run(tree, "test")
    assert "-c constraints/gpu.txt -e '.[test]'" in test_out and "constraints/cpu.txt" not in test_out


def test_fresh_installs_pick_their_pins(tree):
    cpu = _dry_run(tree, "serve")
    assert "-c constraints/cpu.txt -e ." in cpu and "constraints/gpu.txt" not in cpu
    gpu = _dry_run(tree, "serve", "GPU=1")
    assert "-c constraints/gpu.txt -e '.[gpu]'" in gpu and "constraints/cpu.txt" not in gpu
    assert "touch .venv/.installed-gpu" in gpu
    for out in (cpu, gpu):  # the package's bytecode, which PYTHONDONTWRITEBYTECODE=1 would never let processes write
        assert "PYTHONDONTWRITEBYTECODE= .venv/bin/python -m compileall -q rayllm" in out


def test_cpu_serve_after_a_cpu_install_does_nothing_more(tree):
    _touch_after_sources(tree / ".venv" / ".installed")
    assert "pip install" not in _dry_run(tree, "serve")


def test_a_fresh_venv_installs_with_uv_and_pips_find_links(tree, monkeypatch):
    (tree / ".venv" / "bin" / "uv").unlink()
    wheels = tree / "wheels"
    wheels.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", f"{wheels} {tree / 'missing'}")
    out = _dry_run(tree, "install")
    assert "pip install -q --progress-bar off --disable-pip-version-check uv==" in out
    installs = [ln for ln in out.splitlines() if "-e ." in ln]
    assert installs and all(ln.startswith(".venv/bin/uv pip install") for ln in installs)
    assert f"--find-links {wheels}" in installs[0] and "missing" not in installs[0]  # a missing folder is left out
    pip = _dry_run(tree, "install", "INSTALLER=pip")
    assert ".venv/bin/pip install -q --progress-bar off -c constraints/cpu.txt -e ." in pip and "uv" not in pip


def test_test_installs_add_the_test_extra_under_each_platforms_pins(tree):
    assert "-c constraints/cpu.txt -e '.[test]'" in _dry_run(tree, "install-test")
    gpu = _dry_run(tree, "install-test", "GPU=1")
    assert "-e '.[test]'" in gpu and "constraints/cpu.txt" not in gpu


def test_make_test_runs_the_other_folders_in_workers_then_tests_serve_alone(tree):
    _touch_after_sources(tree / ".venv" / ".installed")
    _touch_after_sources(tree / ".venv" / ".installed-test")
    first, second = [ln for ln in _dry_run(tree, "test").splitlines() if "-m pytest" in ln]
    assert "-n 2 --dist loadfile" in first and "--without-serve-apps" in first
    assert second.endswith("--serve-apps-only  tests/serve") and "-n " not in second  # the Serve apps' tests in one process
    # pytest may keep its rewritten test modules (these machines set PYTHONDONTWRITEBYTECODE=1).
    assert first.startswith("PYTHONDONTWRITEBYTECODE= ") and second.startswith("PYTHONDONTWRITEBYTECODE= ")
    serial = [ln for ln in _dry_run(tree, "test", "UNIT_LANES=1").splitlines() if "-m pytest" in ln]
    assert len(serial) == 2 and not any("-n " in ln for ln in serial)


@pytest.mark.parametrize(("marker", "pins", "args"), [(".installed", "cpu.txt", ()), (".installed-gpu", "gpu.txt", ("GPU=1",))])
def test_a_changed_pin_reinstalls(tree, marker, pins, args):
    _touch_after_sources(tree / ".venv" / marker)
    assert "pip install" not in _dry_run(tree, "serve", *args)
    later = time.time() + 10  # the constraints file edited after that install
    os.utime(tree / "constraints" / pins, (later, later))
    assert f"-c constraints/{pins} -e " in _dry_run(tree, "serve", *args)
