#!/usr/bin/env bash
# The one script to run on the GPU device, from the repo root, with the project NOT installed:
#
#   OUT=/some/dir bash bench/device_check.sh [all-tests|gemm-tests|tests|bench|interp]
#
#   all-tests: gemm-tests and tests side by side (two pytest processes on the one GPU; the Triton
#          compiles, which dominate, then use two cores): every @gpu test in ~6 min cold
#   gemm-tests: the @gpu tests of the LUT-B GEMM, its selectors and the dequantizer: every config
#          against the reference, bit-exact decoder and layout checks               (~6-8 min cold)
#   tests: the other @gpu tests: routing, MXFP8, experts (packed, emulated, dense prefill path),
#          CUDA graphs, and the server's GPU tests (serving, compute worker)         (~5-7 min cold)
#   bench: versions, bench/kernels.py into $OUT (BENCH_ARGS="--quick" / "--tune"), SASS counts,
#          and the short table last                                                 (~4-6 min cold)
#   interp: the Triton interpreter tests in a process without the GPU (CI runs them on the CPU
#          with the same triton; here only to rule out a difference on the device)
# Each phase fits one 10-minute device call; the Triton cache in $TRITON_CACHE_DIR is shared.
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE="${1:-tests}"
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

gpu_tests() {  # log name, then test paths
  local log="$OUT/$1.log"; shift
  echo "== GPU tests $* (log: $log)"
  timeout 540 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE "$@" > "$log" 2>&1 || status=1
  grep -E "^(FAIL|FAILED|ERROR)|passed|failed" "$log" | tail -15
}

interp() {
  echo "== CPU interpreter kernel tests (no GPU visible)"
  CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 420 "$PY" -m pytest -q -p no:cacheprovider \
    tests/kernels/triton_interp tests/kernels/test_gpu_experts_without_triton.py > "$OUT/interp_tests.log" 2>&1 || status=1
  tail -3 "$OUT/interp_tests.log"
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
gemm_tests() {
  gpu_tests gpu_tests_gemm tests/kernels/test_lut_b_gemm.py tests/kernels/test_lut_b_gemm_selectors.py \
    tests/kernels/test_lut_b_dequant.py
}

other_tests() {
  gpu_tests gpu_tests tests/kernels/test_routing_triton.py tests/kernels/test_mxfp8_triton.py \
    tests/kernels/test_experts_gpu.py tests/kernels/test_cuda_graphs.py tests/server
}

case "$PHASE" in
  all-tests)
    { gemm_tests; exit "$status"; } > "$OUT/gemm_tests.txt" 2>&1 &  # a subshell: its status comes back by wait
    gemm_pid=$!
    other_tests
    wait "$gemm_pid" || status=1
    cat "$OUT/gemm_tests.txt" ;;
  gemm-tests) gemm_tests ;;
  tests) other_tests ;;
  bench) bench; sass; table ;;
  interp) interp ;;
  *) echo "usage: bash bench/device_check.sh [all-tests|gemm-tests|tests|bench|interp]"; exit 2 ;;
esac
exit $status
