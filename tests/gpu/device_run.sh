#!/bin/bash
# The GPU lane and the 8B-shaped bench in one call of this workplace's device tool (a GPU machine with
# PyTorch and transformers but no network, no Ray, and a 64 MiB limit on what travels). Prepare, here:
#   mkdir -p .gpu/whl && echo /.gpu/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl \
#       xformers==0.0.35 xgrammar gguf google-re2 apache-tvm-ffi pydantic pydantic-core annotated-types \
#       typing-inspection        # (pin each to the versions in .venv)
#   python tests/gpu/trim_gguf.py <the default GGUF> .gpu/smollm2-6layers.gguf --layers 6
#   cp tests/gpu/device_run.sh .gpu/run.sh
# then run `bash .gpu/run.sh [lane|bench|all]` there with carry [".gpu"]; results land in $OUT.
# Env: LANE_S / BENCH_S (time limits), LANE_K (-k filter), BATCHES, BENCH_ARGS (extra bench flags).
set -u
cd "$(dirname "$0")/.."
WHAT=${1:-all}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl > $OUT/pip.log 2>&1 || echo "PIP FAILED"
export PYTHONPATH=$PWD:/tmp/site
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; df -h /dev/shm /tmp;
  python3 -c "import torch,transformers;print('torch',torch.__version__,'cuda',torch.version.cuda,'tf',transformers.__version__,torch.cuda.get_device_name())";
  python3 -c "import xformers, xformers.ops.fmha as f; print('xformers', xformers.__version__, 'ok')";
  python3 -c "import triton; print('triton', triton.__version__)";
  timeout 60 python3 -m xformers.info 2>&1 | grep -iE "fmha|flash|cutlass|build|torch|cuda|triton" | head -40; } > $OUT/env.txt 2>&1
head -8 $OUT/env.txt
if [ "$WHAT" != bench ]; then
  echo "== lane $(date -u +%T)"
  RAYLLM_GPU_TEST_GGUF=$PWD/.gpu/smollm2-6layers.gguf timeout ${LANE_S:-200} python3 -m pytest -m gpu tests/gpu -v \
    -p no:cacheprovider -o addopts="" -rs --tb=short --durations=12 --timeout=120 ${LANE_K:+-k "$LANE_K"} > $OUT/gpu_lane.log 2>&1
  echo "lane rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E  " $OUT/gpu_lane.log | head -60
  timeout 180 python3 -m pytest tests/attention/test_triton_kernels.py tests/attention/test_triton_prefill.py -q -p no:cacheprovider -o addopts="" --tb=short \
    > $OUT/triton_unit.log 2>&1; echo "triton unit rc=$?"; tail -15 $OUT/triton_unit.log
fi
if [ "$WHAT" != lane ]; then
  echo "== bench $(date -u +%T)"
  avail=$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1); [ "${avail:-0}" -gt 24 ] && export TMPDIR=/dev/shm
  timeout ${BENCH_S:-260} python3 benchmarks/engine_bench.py --device cuda --shape llama-3.1-8b --dtypes bfloat16 \
    --batches ${BATCHES:-1,16,64,256} --new-tokens 128 --rounds 1 --profile $OUT/prof ${BENCH_ARGS:---attention-backends triton,sdpa} > $OUT/bench.log 2>&1
  echo "bench rc=$?"; grep -vE "it/s\]|tensor/s\]" $OUT/bench.log | tail -40
  if [ -n "${BENCH2_ARGS:-}" ]; then  # a second shape of run, e.g. long-context decode
    timeout ${BENCH2_S:-200} python3 benchmarks/engine_bench.py --device cuda --shape llama-3.1-8b --dtypes bfloat16 \
      --rounds 1 $BENCH2_ARGS > $OUT/bench2.log 2>&1
    echo "bench2 rc=$?"; grep -vE "it/s\]|tensor/s\]" $OUT/bench2.log | tail -20
  fi
fi
echo "== done $(date -u +%T)"
