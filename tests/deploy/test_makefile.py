"""The install paths: `make -n` (dry run: prints the recipe, runs nothing) in a temporary copy of the
Makefile, pyproject.toml and constraints/, with the venv's marker files simulated by `touch`."""

from __future__ import annotations

import os
import shutil
import signal
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
    return subprocess.run(["make", "-n", *args], cwd=tree, capture_output=True, text=True, check=True).stdout


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


# `make test` run for real with a stand-in for the venv's interpreter (the subject is the recipe's
# orchestration, not pytest): each pass records how it was started, waits for the other where the two should
# overlap, and exits with the status the test asks for.
STUB = """#!/bin/bash
case "$*" in *tests/serve*) pass=serve ;; *) pass=unit ;; esac
d=$STUB_DIR
{ echo "args=$*"; echo "ray_address=${RAY_ADDRESS-}"; echo "nice=$(ps -o ni= -p $$ | tr -d ' ')";
  echo "pgid=$(ps -o pgid= -p $$ | tr -d ' ')"; echo "pid=$$"; } > $d/$pass.info
touch $d/$pass.started
other=serve; [ $pass = serve ] && other=unit
for _ in $(seq 100); do [ -e $d/$other.started ] && break; sleep 0.05; done
[ -e $d/$other.started ] && touch $d/$pass.saw-$other
sleep ${STUB_SLEEP:-0}
echo "$pass output"
exit $(eval echo \\${${pass^^}_RC:-0})
"""


def _stubbed(tree: Path) -> Path:
    _touch_after_sources(tree / ".venv" / ".installed")
    _touch_after_sources(tree / ".venv" / ".installed-test")
    python = tree / ".venv" / "bin" / "python"
    python.write_text(STUB)
    python.chmod(0o755)
    return tree / "stub"


def _make_test(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    stub = tree / "stub"
    stub.mkdir(exist_ok=True)
    return subprocess.run(["make", "-s", "test", *args], cwd=tree, capture_output=True, text=True, timeout=60,
                          env=os.environ | {"STUB_DIR": str(stub)} | env)


def _info(stub: Path, name: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in (stub / f"{name}.info").read_text().splitlines())


def test_make_test_runs_the_other_folders_in_workers_beside_tests_serve(tree):
    stub = _stubbed(tree)
    done = _make_test(tree)
    assert done.returncode == 0, done.stderr
    serve, unit = _info(stub, "serve"), _info(stub, "unit")
    assert serve["args"].endswith("-m slow tests/serve") and "-n " not in serve["args"]  # one process
    assert "-n 2 --dist loadfile" in unit["args"] and "--without-serve-apps" in unit["args"]
    assert (stub / "unit.saw-serve").exists() and (stub / "serve.saw-unit").exists()  # at the same time
    assert unit["nice"] == "19" and serve["nice"] == str(os.nice(0))  # the Serve tests keep their priority
    assert unit["ray_address"] == "local" and serve["ray_address"] == os.environ.get("RAY_ADDRESS", "")
    assert unit["pgid"] == unit["pid"]  # its own group, so that Ctrl-C can stop its workers
    assert done.stdout.index("serve output") < done.stdout.index("unit output")  # the unit log follows


@pytest.mark.parametrize("failing", ["UNIT_RC", "SERVE_RC"])
def test_make_test_fails_when_either_pass_fails(tree, failing):
    _stubbed(tree)
    done = _make_test(tree, **{failing: "1"})
    assert done.returncode != 0
    assert "serve output" in done.stdout and "unit output" in done.stdout  # both ran to the end


def test_ctrl_c_stops_the_unit_pass_too(tree):
    stub = _stubbed(tree)
    (stub).mkdir()
    make = subprocess.Popen(["make", "-s", "test"], cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ | {"STUB_DIR": str(stub), "STUB_SLEEP": "30"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not ((stub / "unit.saw-serve").exists() and (stub / "serve.saw-unit").exists()):
            assert time.monotonic() < deadline and make.poll() is None
            time.sleep(0.05)
        unit = int(_info(stub, "unit")["pid"])
        os.killpg(make.pid, signal.SIGINT)  # what a terminal sends to its foreground group
        make.wait(timeout=20)
        deadline = time.monotonic() + 10
        while _alive(unit):
            assert time.monotonic() < deadline, "the unit pass outlived Ctrl-C"
            time.sleep(0.05)
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_serial_passes_run_one_after_the_other(tree):
    stub = _stubbed(tree)
    for lanes, workers in (("2", True), ("1", False)):
        for f in stub.glob("*"):
            f.unlink()
        done = _make_test(tree, "TEST_PASSES=serial", f"UNIT_LANES={lanes}")
        assert done.returncode == 0, done.stderr
        unit, serve = _info(stub, "unit"), _info(stub, "serve")
        assert not (stub / "unit.saw-serve").exists()  # the unit pass ended before the Serve tests began
        assert ("-n 2" in unit["args"]) == workers and unit["nice"] == serve["nice"] == str(os.nice(0))
