#!/usr/bin/env bash
# `lutb check --suite all` of the GPU backends against the local reference on the CPU, at model shapes, in one
# device call (from the repo root, the project NOT installed):
#
#   OUT=/some/dir bash bench/check_device.sh
#
# For each checkpoint (synthetic, one layer: qwen3-30b-a3b's shape in bfloat16 and in float16, and deepseek-v3's
# H and I with 16 experts) and each backend (packed, emulated), it serves the checkpoint on the GPU (CUDA graphs
# on), checks it, and keeps the JSON report as check-<checkpoint>-<backend>.json in $OUT/check-files.tgz (with the
# text reports, the servers' logs and the exit codes: one file, as the device tool returns few). The table printed last
# gives each pair's exit code, the worst pooled rel L2 and the worst single row of the parts judged per row
# (heavy_tailed, magnitudes/*), against the tolerance and its 10x row bound.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/check-$(date +%Y%m%d-%H%M%S)}"
WORK="${WORK:-/tmp/lutb-check}"
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="kernels:client:server${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/lutb-triton-cache}"
PY="${PYTHON:-python3}"
PORT="${PORT:-50571}"
status=0

lutb() { "$PY" -m lutb_server.cli "$@"; }

synth() {  # name, then lutb synth flags
  local name="$1"; shift
  [ -e "$WORK/$name" ] || lutb synth --out "$WORK/$name" --layers 1 "$@" > "$OUT/synth-$name.log" 2>&1 \
    || { echo "synth $name failed"; tail -5 "$OUT/synth-$name.log"; status=1; }
}

check() {  # checkpoint name, backend
  local name="$1" backend="$2" log="$OUT/serve-$1-$2.log"
  "$PY" -m lutb_server.cli serve --checkpoint "$WORK/$name" --backend "$backend" --device cuda --port "$PORT" --no-validate-checkpoint \
    > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do
    lutb health "127.0.0.1:$PORT" > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || break
    sleep 1
  done
  timeout 300 "$PY" -m lutb_server.cli check "127.0.0.1:$PORT" --checkpoint "$WORK/$name" --device cpu \
    --json "$OUT/check-$name-$backend.json" > "$OUT/check-$name-$backend.txt" 2>&1
  local code=$?
  echo "$name $backend exit $code" | tee -a "$OUT/exit_codes.txt"
  [ "$code" = 0 ] || { status=1; tail -20 "$OUT/check-$name-$backend.txt"; }
  kill -TERM "$pid" 2> /dev/null; wait "$pid" 2> /dev/null
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
synth qwen3-bf16 --experts 128 --hidden 2048 --intermediate 768 --dtype bfloat16
synth qwen3-fp16 --experts 128 --hidden 2048 --intermediate 768 --dtype float16 --seed 1
synth deepseek-e16 --experts 16 --hidden 7168 --intermediate 2048 --dtype bfloat16 --seed 2
for backend in packed emulated; do  # packed first: the backend a GPU server picks
  for name in qwen3-bf16 qwen3-fp16 deepseek-e16; do check "$name" "$backend"; done
done

echo "== check table"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

from lutb_client.check.suites import ROW_JUDGED_PARTS

out = Path(sys.argv[1])
codes = dict(line.rsplit(" exit ", 1) for line in (out / "exit_codes.txt").read_text().splitlines())
print(f"{'checkpoint backend':<24} {'exit':>4} {'verdict':>7} {'worst rel L2':>12} {'worst row (row-judged)':>22}")
for key, code in codes.items():
    path = out / f"check-{key.replace(' ', '-')}.json"
    if not path.exists():
        print(f"{key:<24} {code:>4} {'-':>7}")
        continue
    data = json.loads(path.read_text())
    rows = data["layers"] + data["experts"]  # non-finite figures are kept as the strings "inf" and "nan"
    worst = max((float(r["rel_l2"]) for r in rows), default=float("nan"))
    worst_row = max((float(r["worst_row_rel_l2"]) for r in rows if r["suite"] in ROW_JUDGED_PARTS), default=float("nan"))
    print(f"{key:<24} {code:>4} {data['verdict']:>7} {worst:>12.3e} {worst_row:>22.3e}")
EOF
# The device tool returns a handful of files from $OUT: the reports, logs and exit codes go back as one archive
tar czf "$OUT/check-files.tgz" -C "$OUT" --remove-files $(cd "$OUT" && ls check-*.json check-*.txt serve-*.log synth-*.log exit_codes.txt 2> /dev/null)
exit $status
