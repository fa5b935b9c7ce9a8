#!/usr/bin/env bash
# Issue 5 on the device, one call: the serving GPU tests, then the compute worker as a thread vs a
# child process (bench/worker_pacing.py, then bench/serving.py once per --compute-worker).
#
#   OUT=/dir bash bench/worker_compare_device.sh [serving.py args...]   (~5 min warm)
#   GPU_TESTS="tests/..." OUT=/dir bash bench/worker_compare_device.sh ...  (other GPU tests first)
#   PROFILE_ARGS="--concurrency 64 --apis stream" ...   (then the process worker once more, under py-spy;
#                                                         PROFILE_WORKER=thread profiles the thread instead)
#   FRONT_ENDS="2 4" ...   (and the process worker behind that many front ends, one run each)
#   WORKERS="process" PACING=0 GPU_TESTS="" ...   (fewer single-front-end runs, no pacing, no GPU tests)
#
# Assumes the project is importable from the source tree and the extra wheels are in /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lutb-worker-compare}
W=${WORK:-/tmp/lutb-work}
export PYTHONPATH="kernels:client:server:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/lutb-triton-cache}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mkdir -p "$OUT" "$W"
git rev-parse --short HEAD 2>/dev/null || true
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader 2>/dev/null || true
status=0
GPU_TESTS=${GPU_TESTS-tests/server/test_worker.py tests/server/test_gpu_serving.py tests/kernels/test_cuda_graphs.py}
WORKERS=${WORKERS-thread process}
if [[ -n $GPU_TESTS ]]; then
  echo "== GPU tests: $GPU_TESTS (log: gpu-tests.txt)"
  # shellcheck disable=SC2086  # a list of paths (and pytest options such as -k)
  timeout 330 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rfE --timeout 150 $GPU_TESTS > "$OUT/gpu-tests.txt" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -12
fi
if [[ ${PACING:-1} != 0 ]]; then
  echo "== worker pacing (thread vs process)"
  timeout 150 "$PY" bench/worker_pacing.py --out "$W/wp" --tokens 1 16 --seconds 0.6 \
    --busy-switch-intervals-us 200 > "$OUT/worker-pacing.txt" 2>&1 || status=1
  cp "$W/wp/"*.json "$OUT/" 2>/dev/null
fi
for cw in $WORKERS; do
  echo "== serving, compute worker: $cw"
  timeout 170 "$PY" bench/serving.py --out "$W/sv-$cw" --compute-worker "$cw" --duration-s 1.5 --warmup-s 0.3 \
    --inproc-s 0.3 "$@" > "$OUT/serving-$cw.txt" 2>&1 || status=1
  cp "$W/sv-$cw/serving.json" "$OUT/serving-$cw.json" 2>/dev/null
done
for fe in ${FRONT_ENDS:-}; do
  echo "== serving, compute worker: process, $fe front ends"
  timeout 170 "$PY" bench/serving.py --out "$W/sv-fe$fe" --compute-worker process --front-ends "$fe" --duration-s 1.5 \
    --warmup-s 0.3 --inproc-s 0.3 "$@" > "$W/serving-fe$fe.txt" 2>&1 || status=1  # $OUT: 8 files at most
  cp "$W/sv-fe$fe/serving.json" "$OUT/serving-fe$fe.json" 2>/dev/null
done
if [[ -n ${PROFILE_ARGS:-} ]]; then  # e.g. "--concurrency 64 --apis stream": the process worker under py-spy
  echo "== serving, compute worker: ${PROFILE_WORKER:-process}, profiled ($PROFILE_ARGS)"
  # shellcheck disable=SC2086  # a list of arguments
  timeout 150 "$PY" bench/serving.py --out "$W/sv-profile" --compute-worker "${PROFILE_WORKER:-process}" --duration-s 1.5 --warmup-s 0.3 \
    --inproc-s 0.3 --profile --shapes qwen3-30b-a3b --wires bf16 --tokens 16 $PROFILE_ARGS > /dev/null 2>&1 || status=1
  cp "$W"/sv-profile/profile-*.top.txt "$OUT/profile-${PROFILE_WORKER:-process}.top.txt" 2>/dev/null
fi
[[ ${PACING:-1} != 0 ]] && { echo; echo "== pacing"; grep -A 40 '^| T | mode' "$OUT/worker-pacing.txt" || tail -20 "$OUT/worker-pacing.txt"; }
for cw in $WORKERS ${FRONT_ENDS:+$(printf 'fe%s ' $FRONT_ENDS)}; do
  echo; echo "== serving ($cw)"; grep -A 30 '^| shape' "$W/sv-$cw/serving.md" 2>/dev/null || tail -15 "$OUT/serving-$cw.txt" "$W/serving-$cw.txt" 2>/dev/null
done
exit $status
