#!/usr/bin/env bash
# Issue 5 (serving fast) on the device: the GPU tests, then bench/serving.py; the short table prints last.
#
#   bash bench/serving_device.sh            # tests + bench (both shapes; may pass 10 min: run the two stages as two calls)
#   bash bench/serving_device.sh tests      # only the GPU tests (CUDA graphs, compute worker, GPU serving)
#   bash bench/serving_device.sh bench --shapes qwen3-30b-a3b --profile     # only the bench; extra args go to it
#   bash bench/serving_device.sh graphs     # bench/graph_limit.py: one graph, chunks, eager, split, larger graphs
#   bash bench/serving_device.sh ab ab_old --shapes qwen3-30b-a3b --tokens 16   # bench/ab_serving.py: this tree against
#                                           # the whole tree ab_old (git archive <rev> | tar -x -C ab_old), 2 interleaved pairs
#
# Assumes the project is importable from the source tree and the extra wheels are in /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lutb-serving}
STAGE=${1:-all}
shift || true
export PYTHONPATH="kernels:client:server:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/lutb-triton-cache}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
tests_status=0
bench_status=0
if [[ $STAGE == all || $STAGE == tests ]]; then
  echo "== GPU tests (CUDA graphs, compute worker, GPU serving) =="
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rxXfE \
    tests/kernels/test_cuda_graphs.py tests/server/test_worker.py tests/server/test_gpu_serving.py > "$OUT/gpu-tests.txt" 2>&1
  tests_status=$?
  tail -n 40 "$OUT/gpu-tests.txt"
  echo "== GPU tests exit status: $tests_status (full log: $OUT/gpu-tests.txt) =="
fi
if [[ $STAGE == graphs ]]; then
  echo "== bench/graph_limit.py (qwen3; JSON: limit/graph_limit.json in $OUT/limit.tgz) =="
  timeout 540 "$PY" bench/graph_limit.py --out "$OUT/limit" "$@"
  bench_status=$?
fi
if [[ $STAGE == ab ]]; then
  OLD_TREE=${1:?usage: serving_device.sh ab OLD_TREE [bench/serving.py args]}
  shift
  echo "== bench/ab_serving.py: this tree against $OLD_TREE (runs under ab/ in $OUT/ab.tgz) =="
  timeout 580 "$PY" bench/ab_serving.py --old "$OLD_TREE" --out "$OUT/ab" --pairs 2 --budget-s 560 -- \
    --work-dir /tmp/lutb-ckpt --duration-s 1.5 --warmup-s 0.3 --inproc-s 0.3 "$@"
  bench_status=$?
fi
if [[ $STAGE == all || $STAGE == bench ]]; then
  echo "== bench/serving.py (server logs: bench/logs/ in $OUT/bench.tgz) =="
  timeout 540 "$PY" bench/serving.py --out "$OUT/bench" --duration-s 1.5 --warmup-s 0.3 --inproc-s 0.3 "$@"
  bench_status=$?
  echo "(bench exit status $bench_status; tests exit status $tests_status)"
  if [[ -f $OUT/bench/serving.md ]]; then
    echo
    grep -A 200 '^| shape' "$OUT/bench/serving.md"
  fi
fi
# The device tool returns only a few files from $OUT: a bench run writes a dozen (a server log, one per echo
# process, serving.json/.md), and its serving.json once did not come back. Each stage's directory travels as one
# tarball instead (tar -xzf bench.tgz).
for stage_dir in bench ab limit; do
  if [[ -d $OUT/$stage_dir ]]; then
    tar -czf "$OUT/$stage_dir.tgz" -C "$OUT" "$stage_dir" && rm -rf "${OUT:?}/$stage_dir" && echo "(packed $OUT/$stage_dir.tgz)"
  fi
done
exit $(( tests_status != 0 ? tests_status : bench_status ))
