"""benchmarks/pytest_cpu_profile.py in a real pytest run: one line per test, with the CPU the test burned
counted for the machine and for pytest's own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_test_gets_its_wall_and_cpu_time(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import time\n\n"
        "def test_burns():\n    end = time.process_time() + 0.4\n    while time.process_time() < end:\n        pass\n\n"
        "def test_sleeps():\n    time.sleep(0.4)\n")
    out = tmp_path / "profile.jsonl"
    env = os.environ | {"PYTHONPATH": str(ROOT / "benchmarks"), "CPUPROF_OUT": str(out)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_cpu_profile",
                          str(tmp_path / "test_burn.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = {line["id"].split("::")[1]: line for line in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"test_burns", "test_sleeps"}
    burns, sleeps = lines["test_burns"], lines["test_sleeps"]
    assert burns["wall"] >= 0.4 and burns["busy_cpu_s"] >= 0.3 and burns["kinds"]["pytest"] >= 0.3
    assert sleeps["wall"] >= 0.4 and sleeps["kinds"].get("pytest", 0) < 0.2
