"""The device run's own tooling, on any machine: device_budget.sh's clock (a stage's limit fitted under the
run's deadline, a stage that would not fit skipped with a summary line), serve_device.sh's exit trap (a run cut
short still ends its summary), and gpu_procs' readings of /proc and of nvidia-smi's table."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.gpu.gpu_procs import assigned_uuids, open_device_files, parse_compute_apps

ROOT = Path(__file__).resolve().parents[2]


def budget(script: str, elapsed_s: int, deadline_s: int, tmp_path: Path) -> tuple[list[str], str]:
    """`script` run by bash after device_budget.sh, in a run elapsed_s seconds old: its output and the summary."""
    summary = tmp_path / "summary.txt"
    env = os.environ | {"S": str(summary), "T0": str(int(time.time()) - elapsed_s), "DEADLINE_S": str(deadline_s)}
    run = subprocess.run(["bash", "-c", f". tests/gpu/device_budget.sh\n{script}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return run.stdout.splitlines(), summary.read_text()


def test_a_stage_gets_its_own_limit_while_the_deadline_is_far(tmp_path):
    out, summary = budget('stage engine 180 40 100 && echo "LIMIT=$LIMIT"', 200, 540, tmp_path)
    assert out[-1] == "LIMIT=180" and summary.startswith("== engine at +20")  # 240 s left beyond the 100 kept


def test_a_stage_near_the_deadline_gets_what_is_left(tmp_path):
    out, _ = budget('stage tests 150 45 45 && echo "LIMIT=$LIMIT"', 400, 540, tmp_path)
    assert out[-1] in ("LIMIT=95", "LIMIT=94")  # 540 - 400 - 45 (a second may pass before the stage reads it)


def test_a_stage_that_would_not_fit_is_skipped_with_a_summary_line(tmp_path):
    out, summary = budget('stage profile 90 30 45 || echo "rc=$? SKIPPED=$SKIPPED"; stage lane 90 10 && '
                          'echo "LIMIT=$LIMIT"', 480, 540, tmp_path)
    assert "rc=1 SKIPPED=profile " in out and out[-1] in ("LIMIT=60", "LIMIT=59")
    assert "== profile SKIPPED at +48" in summary and "before the deadline (+540 s), it needs 30" in summary


def test_a_failed_stage_is_what_fails_the_run_not_a_line_that_says_rc(tmp_path):
    out, summary = budget('say "commit 0123 a subject (rc=1)"; result bench 0; result tests 1; echo "FAILED=$FAILED"',
                          0, 540, tmp_path)
    assert out[-1] == "FAILED=tests " and summary.splitlines()[1:] == ["bench rc=0", "tests rc=1"]


def test_a_run_that_cannot_fit_its_models_ends_its_summary_through_the_trap(tmp_path):
    """No stage fits a 5 s deadline: the models are skipped, and the exit trap still writes the end."""
    out = tmp_path / "out"
    env = os.environ | {"REHEARSAL": "1", "DEADLINE_S": "5", "OUT": str(out), "MODELS": str(tmp_path / "models"),
                        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", "tests/gpu/serve_device.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    summary = (out / "summary.txt").read_text()
    assert run.returncode == 1, run.stdout + run.stderr
    assert "== models SKIPPED" in summary and "skipped for the deadline: models" in summary
    assert summary.rstrip().splitlines()[-1].startswith("== done at +") and not (tmp_path / "models").exists()


def test_nvidia_smi_rows_parse_with_unknown_memory():
    rows = "1234, GPU-6f1a, 15000\n5678, GPU-6f1a, [N/A]\n\n"
    assert parse_compute_apps(rows) == {1234: ("GPU-6f1a", 15000), 5678: ("GPU-6f1a", None)}
    assert parse_compute_apps("") == {}


def test_open_device_files_reads_a_process_fds(tmp_path):
    held = tmp_path / "held"
    with open(held, "w"):
        assert open_device_files(os.getpid(), str(tmp_path)) == {str(held)}
    assert open_device_files(os.getpid(), str(tmp_path)) == set()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert open_device_files(gone.pid, "/") == set()


def test_cuda_visible_devices_name_gpus_by_index_or_uuid():
    uuids = {"0": "GPU-aa", "1": "GPU-bb"}
    assert assigned_uuids("1", uuids) == {"GPU-bb"}
    assert assigned_uuids("0,GPU-bb", uuids) == {"GPU-aa", "GPU-bb"}
