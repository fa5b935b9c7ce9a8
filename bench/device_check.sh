#!/usr/bin/env bash
# The one script to run on the GPU device, from the repo root, with the project NOT installed:
#
#   OUT=/some/dir bash bench/device_check.sh [all|tests|bench]     (default: all)
#
#   tests: versions, kernel tests on the CPU interpreter (a process without the GPU), the @gpu
#          kernel tests, SASS instruction counts of the packed kernel        (~4-6 min cold)
#   bench: versions, bench/kernels.py into $OUT (BENCH_ARGS="--quick" / "--tune"), SASS counts,
#          and the short table last                                           (~4-6 min cold)
#   all:   both, in that order (may exceed a 10-minute command limit on a cold machine: then
#          run "tests" and "bench" as two calls; the Triton cache in $TRITON_CACHE_DIR is shared)
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE="${1:-all}"
OUT="${OUT:-bench/results/device-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export PYTHONPATH="kernels:client:server${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/lutb-triton-cache}"
PY="${PYTHON:-python3}"
status=0

versions() {
  echo "== versions"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | head -3
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__, '|', torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  "$PY" -c "import pytest; print('pytest', pytest.__version__)"
}

tests() {
  echo "== CPU interpreter kernel tests (no GPU visible)"
  CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/triton_interp tests/kernels/test_gpu_experts_without_triton.py > "$OUT/interp_tests.log" 2>&1 || status=1
  tail -3 "$OUT/interp_tests.log"
  echo "== GPU tests (log: $OUT/gpu_tests.log)"
  timeout 420 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE tests/kernels/test_routing_triton.py tests/kernels/test_mxfp8_triton.py tests/kernels/test_lut_b_gemm_selectors.py tests/kernels/test_lut_b_gemm.py \
    tests/kernels/test_experts_gpu.py > "$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E "^(FAIL|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
}

sass() {
  echo "== SASS of lut_b_moe_gemm_kernel (files: $OUT/sass)"
  "$PY" bench/sass_summary.py --out "$OUT/sass" 2>&1 | tail -24
}

bench() {
  echo "== benchmark (log: $OUT/bench.log)"
  timeout 540 "$PY" bench/kernels.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || status=1
  grep -E "^\[tune\]" "$OUT/bench.log" | tail -20
}

table() {
  echo "== benchmark table"
  if [ -s "$OUT/results.md" ]; then sed -n '/^wrote /,$p' "$OUT/bench.log"; else tail -30 "$OUT/bench.log"; fi
}

versions
case "$PHASE" in
  tests) tests; sass ;;
  bench) bench; sass; table ;;
  all) tests; bench; sass; table ;;
  *) echo "usage: bash bench/device_check.sh [all|tests|bench]"; exit 2 ;;
esac
exit $status
