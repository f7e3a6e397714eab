#!/usr/bin/env bash
# Everything an H200 run needs, in one call, each step under its own time limit (seconds) so that one slow step
# cannot starve the rest. One log ($OUT/device.log) and the results files ($OUT/results) come back: the device
# tool returns at most 8 files. Order: the kernel A/B (when asked for), correctness, the benchmarks and sweeps, where
# the time goes.
#   bash tools/device_tests.sh [bench args...]
#   (the GPU suites took about 390 s together on the H200, in separate runs at 271685a-68d5227: test_gpu 108,
#   safety 36, sequence-parallel 141, layer 75, distributed 25, plus the checkpoints)
#   TEST_FILTER='accuracy or graph' TESTS_S=150 EXACT_S=150 KERNELS_S=40 VARIANTS_S=120 CKPT_S=40 NCU_S=90
#   TEST_FILES='tests/test_gpu_warpgroup.py' (the GPU test files to run, one step each, in order, within TESTS_S
#   seconds together; default: every GPU suite)
#   NCU_KERNEL=prepare|solve|recurrence|transition|scan|decode|state_chain|decode_step NCU_WORKLOAD=H96_B1_T8192
#   (the ncu step's target)
#   NCU_PACKAGE=<commit>: the ncu step runs .ab/fastkda_<commit> (ab_packages.py --make; carry .ab)
#   DSWEEP_S=90 SSWEEP_S=120 PSWEEP_S=100 BENCH_S=200 MODELS_S=240 (0 skips a step; the bench appends to today's
#   committed results file; MODELS_ARGS: fastkda.bench.models' arguments)
#   PSWEEP_ARGS, SSWEEP_ARGS, VARIANTS_ARGS: extra arguments of tools/sweeps/plan_sweep.py,
#   tools/sweeps/segment_sweep.py and tools/variants/prepare_variants.py
#   AB_S, AB_ARGS: the same-run A/B against packages of other commits (tools/variants/ab_packages.py; carry .ab)
#   KERNELS_ARGS, and KERNELS2_S with KERNELS2_ARGS for a second run: tools/profiling/kernel_times.py's arguments
#   (e.g. --only H24_N1_T65536, then the same with --package <commit>)
set -uo pipefail
OUT=${OUT:-/tmp/fastkda-out}
STEP_LOGS=${TMPDIR:-/tmp}  # each step's own log, besides $LOG
mkdir -p "$OUT/results"
LOG="$OUT/device.log"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FLA_FLASH_KDA=0
if ls .whl/*.whl >/dev/null 2>&1; then  # peers travel as wheels (README of the device tool)
  # a warm machine keeps /tmp between calls: the same wheels, already installed there, are not installed again
  wheels=$(cd .whl && sha256sum -- *.whl)
  if [ "$wheels" = "$(cat /tmp/site/.fastkda-wheels 2>/dev/null)" ] \
      || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
             .whl/*.whl && echo "$wheels" > /tmp/site/.fastkda-wheels; }; then
    export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
else  # the wheels are git-ignored: only the run's carry brings them
  echo "WARNING: no peer wheels in .whl/ (carry .whl): FlashKDA and FLA will be missing from the bench" | tee -a "$LOG"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
# FLA autotunes each kernel for every new shape, which took most of a bench call (2abb1c7: 7 workloads in 520 s).
# Triton keeps the timings it chose on disk when asked; they come back as $OUT/autotune-cache.tgz, and the next
# call reuses them when .autotune-cache (git-ignored: `mkdir .autotune-cache && tar xzf <that file> -C
# .autotune-cache`) travels in its carry. FLA then compiles only the configuration it chose before.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -d .autotune-cache ]; then
  cp -r .autotune-cache/. "$TRITON_CACHE_DIR/"
  echo "autotune timings reused: $(find .autotune-cache -name '*.autotune.json' | wc -l) files" | tee -a "$LOG"
fi
save_autotune() {  # the timings of every autotuned kernel so far, one small file
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/autotune-cache.tgz" -T -)
}
trap save_autotune EXIT
# the name the bench gives it (fastkda.bench.report.results_stem: the date and this GPU's name), from the bench's
# own rule (session 33's H100 run started a fresh file beside the committed one, when this line named the H200's)
today="$(python3 -c 'from fastkda.bench.report import results_stem; print(results_stem("benchmarks/results"))').json"
# the bench appends to today's committed file; a second run of this script in the same call keeps what the first
# wrote (session 25 lost a bench step's rows to this copy). Export FASTKDA_COMMIT for the whole command: without it
# the copied tree's stale .git stamps the rows.
[ -f "$today" ] && [ ! -f "$OUT/results/$(basename "$today")" ] && cp "$today" "$OUT/results/"

step() {  # step NAME SECONDS COMMAND...: run unless SECONDS is 0, append to the log, show its summary lines
  local name=$1 seconds=$2; shift 2
  [ "$seconds" = 0 ] && return
  echo "== $name" >> "$LOG"
  # the log grows as the step runs: a call that its own limit ends keeps what the step printed (session 27 lost
  # a whole GPU-test step that the limit cut, when the log was copied after the step)
  timeout "$seconds" "$@" 2>&1 | tee "$STEP_LOGS/$name.log" >> "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name (rc=$rc)"
  grep -E "^\[|passed|failed|Error" "$STEP_LOGS/$name.log" | grep -v " eager: " | tail -40
}
step prepare-variants "${VARIANTS_S:-0}" python3 tools/variants/prepare_variants.py ${VARIANTS_ARGS:-}
TEST_FILES=${TEST_FILES:-"tests/test_gpu.py tests/test_checkpoints.py tests/test_gpu_safety.py
  tests/test_gpu_sequence_parallel.py tests/test_gpu_layer.py tests/test_gpu_distributed.py
  tests/test_gpu_warpgroup.py"}
# one step a file, in order, each with what is left of TESTS_S (whole seconds): a file that the limit cuts still
# leaves the files before it their own summary line (session 34's calls lost three summaries to one cut step), and
# says how far it got (tools/pytest_progress.py writes each test's outcome as it is known); --durations names the
# slow tests for the next split
counted() {  # counted OUTCOMES: the tests of the running file whose outcome matches OUTCOMES (a pattern), so far
  if [ -f "$FASTKDA_TEST_PROGRESS" ]; then grep -cE "^($1) " "$FASTKDA_TEST_PROGRESS"; else echo 0; fi
}
tests_left=${TESTS_S:-600}
if ! [[ $tests_left =~ ^[0-9]+$ ]]; then
  echo "TESTS_S must be whole seconds, got '$tests_left': no GPU tests" | tee -a "$LOG"
  tests_left=0
fi
[ "$tests_left" -eq 0 ] && TEST_FILES=""  # TESTS_S=0: no GPU tests
for test_file in $TEST_FILES; do
  name="gpu-tests-$(basename "$test_file" .py)"
  [ "$tests_left" -le 5 ] && { echo "== $name: not run (TESTS_S spent)" | tee -a "$LOG"; continue; }
  began=$(date +%s)
  export FASTKDA_TEST_PROGRESS="$STEP_LOGS/$name.progress"
  rm -f "$FASTKDA_TEST_PROGRESS"
  # shellcheck disable=SC2086
  step "$name" "$tests_left" python3 -m pytest -q -s -p tools.pytest_progress --durations=5 "$test_file" \
    ${TEST_FILTER:+-k "$TEST_FILTER"}
  echo "   (progress: $(counted passed) passed, $(counted 'failed|error') failed or errors," \
    "$(counted skipped) skipped)" | tee -a "$LOG"
  tests_left=$(( tests_left - ($(date +%s) - began) ))
  [ "$tests_left" -lt 0 ] && tests_left=0
done
unset FASTKDA_TEST_PROGRESS
step exactness "${EXACT_S:-0}" python3 tools/sweeps/exactness_matrix.py
step ab "${AB_S:-0}" python3 tools/variants/ab_packages.py --out "$OUT/results" ${AB_ARGS:-}
step decode-sweep "${DSWEEP_S:-0}" python3 tools/sweeps/decode_sweep.py --out "$OUT/results"
step bench "${BENCH_S:-400}" python3 -m fastkda.bench --append --out "$OUT/results" "$@"
save_autotune  # now too, in case the call's own limit ends the script before its exit trap
# shellcheck disable=SC2086
step segment-sweep "${SSWEEP_S:-0}" python3 tools/sweeps/segment_sweep.py --out "$OUT/results" ${SSWEEP_ARGS:-}
step plan-sweep "${PSWEEP_S:-0}" python3 tools/sweeps/plan_sweep.py --out "$OUT/results" \
  --budget-s "${PSWEEP_BUDGET:-60}" \
  ${PSWEEP_ARGS:-}
# shellcheck disable=SC2086  # the argument lists split on purpose
step kernel-times "${KERNELS_S:-60}" python3 tools/profiling/kernel_times.py ${KERNELS_ARGS:-}
# shellcheck disable=SC2086
step kernel-times-2 "${KERNELS2_S:-0}" python3 tools/profiling/kernel_times.py ${KERNELS2_ARGS:-}
step checkpoint-cost "${CKPT_S:-0}" python3 tools/sweeps/checkpoint_cost.py
# transformers' tiny models three ways (its eight cases took more than 170 s on an H100: MODELS_ARGS="--cases 1x64
# 1x2048" for fewer, and "--profile" for where a generated token's host time goes); it writes its files after each
# case, so a limit that ends it keeps the cases it finished
# (today's committed models file travels along as the bench's does, and the cases this call measures replace theirs)
models_file="${today%.json}-models.json"
[ -f "$models_file" ] && [ ! -f "$OUT/results/$(basename "$models_file")" ] && cp "$models_file" "$OUT/results/"
# shellcheck disable=SC2086
step models "${MODELS_S:-0}" python3 -m fastkda.bench.models --append --out "$OUT/results" ${MODELS_ARGS:-}
NCU_KERNEL=${NCU_KERNEL:-prepare} NCU_WORKLOAD=${NCU_WORKLOAD:-H96_B1_T8192}  # the kernel's Triton name less _kernel
[ "$NCU_KERNEL" = scan ] && ncu_name=segment_scan || ncu_name=$NCU_KERNEL
# a decode workload (decode_*) runs the decode step, its memory floor and the fused step (NCU_KERNEL=decode,
# state_chain or decode_step; this tree's kernels only, no NCU_PACKAGE)
ncu_runner=tools/profiling/ncu_prepare.py
case $NCU_WORKLOAD in decode_*) ncu_runner=tools/profiling/ncu_decode.py ;; esac
step ncu "${NCU_S:-0}" bash -c "ncu --clock-control none --set full --import-source yes -k regex:${ncu_name}_kernel \
  --launch-count 1 -f -o /tmp/k python3 $ncu_runner --only $NCU_WORKLOAD ${NCU_PACKAGE:+--package $NCU_PACKAGE} \
  && ncu -i /tmp/k.ncu-rep --page details && ncu -i /tmp/k.ncu-rep --page source --print-source sass --csv \
  > /tmp/k-sass.csv && gzip -c /tmp/k-sass.csv > $OUT/results/ncu-$NCU_KERNEL-$NCU_WORKLOAD-sass.csv.gz \
  && python3 tools/profiling/ncu_hotspots.py /tmp/k-sass.csv \
  && python3 tools/profiling/ncu_lines.py $NCU_KERNEL /tmp/k-sass.csv --workload $NCU_WORKLOAD"
