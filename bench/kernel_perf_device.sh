#!/usr/bin/env bash
# ONE device call (~8 min cold on an H200) for the packed-kernel performance work, from the repo root:
#
#   OUT=/some/dir bash bench/kernel_perf_device.sh
#   OUT=/some/dir STAGES="tests breakdown bench sass" bash bench/kernel_perf_device.sh   # a subset
#
# Stages, each under its own timeout so one slow stage cannot eat the call (shared Triton cache):
#   1. GPU smoke tests guarding the numbers (dequant, selectors, experts; -x) <= 150 s
#      (the full GPU suites are `bash bench/device_check.sh gemm-tests` and `... tests`, a call each)
#   2. breakdown: per-stage times of the packed forward, T 1/8/32          <= 120 s
#   3. full bench: bench/kernels.py, all shapes, all T (+ prefill path A/B) <= 170 s
#   4. tune sweep: GEMM alone, decode + large T, mixtral/deepseek           <= 80 s (stops starting shapes at 50 s)
#   5. SASS counts of the compiled packed kernels (from the Triton cache)  <= 20 s
#   pdl (not in the default list): bench/kernels.py at decode T (1 8 32), all shapes, packed also timed
#      with programmatic dependent launch off (--ab pdl)                     <= 200 s
#   unroll (not in the default list): bench/kernels.py at T 1..512, all shapes, packed also timed with the
#      K loop not unrolled (--ab unroll: TILE_UNROLL 2 vs 1, 5 interleaved pairs)  <= 260 s
#   streamk (not in the default list): bench/kernels.py at T 1..512, all shapes, packed also timed on the
#      plain grid (--ab stream_k: STREAM_K_PER_SM 4 vs 0, 5 interleaved pairs)  <= 260 s
#   stalls (not in the default list): Nsight Compute's stall reasons (cycles per issued instruction
#      by reason) and top stall sites of the two GEMMs of a mixtral T=1 forward  <= 150 s
# Files under $OUT (8): gpu_tests.log breakdown.log breakdown.json bench.log results.json results.md tune.log tune.json
# (pdl writes pdl.log and results.json; unroll unroll.log, streamk streamk.log, each with results.json; stalls writes stalls.log)
# The short tables are printed LAST.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kernel-perf-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
export PYTHONPATH="kernels:client:server${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/lutb-triton-cache}"
PY="${PYTHON:-python3}"
STAGES="${STAGES:-tests breakdown bench tune sass}"
want() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }

stamp "versions"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | head -2
"$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"

if want tests; then
  stamp "1. GPU kernel tests"
  timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu -x tests/kernels/test_lut_b_dequant.py \
    tests/kernels/test_lut_b_gemm_selectors.py tests/kernels/test_experts_gpu.py tests/kernels/test_cuda_graphs.py > "$OUT/gpu_tests.log" 2>&1
  echo "rc=$?" >> "$OUT/gpu_tests.log"
  tail -4 "$OUT/gpu_tests.log"
fi

if want breakdown; then
  stamp "2. breakdown"
  timeout 120 "$PY" bench/kernels.py --breakdown --out "$WORK/bd" > "$OUT/breakdown.log" 2>&1; echo "rc=$?" >> "$OUT/breakdown.log"
  cp "$WORK/bd/breakdown.json" "$OUT/" 2>/dev/null
fi

if want bench; then
  stamp "3. full bench"
  timeout 170 "$PY" bench/kernels.py --out "$WORK/bench" > "$OUT/bench.log" 2>&1; echo "rc=$?" >> "$OUT/bench.log"
  cp "$WORK/bench/results.json" "$WORK/bench/results.md" "$OUT/" 2>/dev/null || cp "$WORK/bench/results.partial.json" "$OUT/results.json" 2>/dev/null
fi

if want tune; then
  stamp "4. tune sweep"
  timeout 80 "$PY" bench/kernels.py --tune-only --tune-budget 50 --out "$WORK/tune" > "$OUT/tune.log" 2>&1; echo "rc=$?" >> "$OUT/tune.log"
  cp "$WORK/tune/tune.json" "$OUT/" 2>/dev/null
fi

if want unroll; then
  stamp "unroll: T 1..512, TILE_UNROLL 2 vs 1"
  timeout 260 "$PY" bench/kernels.py --tokens 1 8 32 128 512 --ab unroll --out "$WORK/unroll" > "$OUT/unroll.log" 2>&1; echo "rc=$?" >> "$OUT/unroll.log"
  cp "$WORK/unroll/results.json" "$OUT/" 2>/dev/null || cp "$WORK/unroll/results.partial.json" "$OUT/results.json" 2>/dev/null
fi

if want streamk; then
  stamp "streamk: T 1..512, stream-K vs plain grid"
  timeout 260 "$PY" bench/kernels.py --tokens 1 8 32 128 512 --ab stream_k --out "$WORK/streamk" > "$OUT/streamk.log" 2>&1; echo "rc=$?" >> "$OUT/streamk.log"
  cp "$WORK/streamk/results.json" "$OUT/" 2>/dev/null || cp "$WORK/streamk/results.partial.json" "$OUT/results.json" 2>/dev/null
fi

if want pdl; then
  stamp "pdl: decode T, PDL on/off"
  timeout 200 "$PY" bench/kernels.py --tokens 1 8 32 --ab pdl --out "$WORK/pdl" > "$OUT/pdl.log" 2>&1; echo "rc=$?" >> "$OUT/pdl.log"
  cp "$WORK/pdl/results.json" "$OUT/" 2>/dev/null || cp "$WORK/pdl/results.partial.json" "$OUT/results.json" 2>/dev/null
fi

if want stalls; then
  stamp "stalls: ncu stall reasons, mixtral T=1 GEMMs"
  NCU="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
  timeout 150 "$NCU" --clock-control none --kernel-name regex:lut_b_moe_gemm_kernel --launch-skip 6 --launch-count 2 \
    --section WarpStateStats --section SourceCounters \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    "$PY" bench/ncu_gemm.py --shape mixtral-8x7b --tokens 1 > "$OUT/stalls.log" 2>&1; echo "rc=$?" >> "$OUT/stalls.log"
fi

if want sass; then
  stamp "5. SASS counts (appended to bench.log)"
  { echo "== SASS (bench/sass_summary.py)"; timeout 20 "$PY" bench/sass_summary.py --out "$WORK/sass" 2>&1 | tail -30; } >> "$OUT/bench.log"
  tail -31 "$OUT/bench.log" | head -30
fi

stamp "done; summary"
echo
echo "================ GPU tests";   grep -E "passed|failed|error|rc=" "$OUT/gpu_tests.log" | tail -4
echo "================ breakdown";   sed -n '/^breakdown:/,$p' "$OUT/breakdown.log" | head -40; grep -E "Error|rc=" "$OUT/breakdown.log" | tail -3
echo "================ stalls";      grep -E "issue_stalled|Warp Cycles|rc=" "$OUT/stalls.log" 2>/dev/null | sort -t' ' -k3 | tail -30
echo "================ unroll";      sed -n '/^unroll:/,$p' "$OUT/unroll.log" 2>/dev/null | head -20; grep -E "Error|rc=" "$OUT/unroll.log" 2>/dev/null | tail -3
echo "================ streamk";     sed -n '/^stream_k:/,$p' "$OUT/streamk.log" 2>/dev/null | head -20; grep -E "Error|rc=" "$OUT/streamk.log" 2>/dev/null | tail -3
echo "================ pdl";         sed -n '/^pdl:/,$p' "$OUT/pdl.log" 2>/dev/null | head -20; grep -E "Error|rc=" "$OUT/pdl.log" 2>/dev/null | tail -3
echo "================ tune";        sed -n '/^tune:/,$p' "$OUT/tune.log" | head -40; grep -E "^\[tune\] budget|Error|rc=" "$OUT/tune.log" | tail -4
echo "================ bench (targets vs HBM READ bandwidth)"
if grep -q "^wrote " "$OUT/bench.log"; then sed -n '/^wrote /,/^== SASS/p' "$OUT/bench.log" | grep -v "^== SASS"; else tail -25 "$OUT/bench.log"; fi
stamp "end"
