#!/usr/bin/env bash
# Everything the H200 run needs, in one call: peers from carried wheels, GPU tests, kernel times, benchmark.
# Usage (device tool, repo root): bash scripts/device_tests.sh [bench args...]; logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/fastkda-out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
# each step has its own time limit (seconds) so one slow step cannot starve the others
timeout "${BENCH_S:-400}" python3 -m fastkda.bench --out-dir "$OUT/results" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_S:-600}" python3 -m pytest -q -s tests/test_gpu.py tests/test_checkpoints.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
    | tee "$OUT/gpu-tests.log" | grep -E "accuracy|passed|failed|Error" | tail -20
fi
timeout "${KERNELS_S:-120}" python3 scripts/kernel_times.py 2>&1 | tee "$OUT/kernel-times.log" | grep kernels
