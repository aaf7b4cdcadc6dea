#!/usr/bin/env bash
# Run every issue-7 benchmark in priority order, each in its own process under a time limit, within one
# overall budget; logs and results go to OUTDIR (bench.log, results.jsonl, ceilings.json).
#
#   benchmarks/run_all.sh [OUTDIR]            # on the GPU machine: benchmarks/run_all.sh "$OUT"
#   SMOKE=1 PYTHON=.venv/bin/python benchmarks/run_all.sh /tmp/bo     # CPU toy sizes (debugging)
#   BUDGET_S=400 ONLY="ceilings decode_dsv32" benchmarks/run_all.sh "$OUT"
#
# PYTHON: the interpreter (default python3, the GPU machine's). Exit status: 1 when any benchmark that ran
# failed (each one's rc is in bench.log), else 0.
#
# Order = priority (what the goals need first): ceilings, DSA decode (goal 1; W8A8 as the checkpoint asks,
# then weight-only), Qwen3 throughput
# (goal 2), load (goal 3: dense bf16, then an FP8 MoE checkpoint), Qwen3 decode, prefill, DSA-model throughput, TTFT/TPOT through the HTTP server
# (carry .device-wheels for it). A benchmark that would start with
# less than 30 s of budget left is skipped and says so.
set -u
OUTDIR=${1:-${OUT:-bench_out}}
mkdir -p "$OUTDIR"
export BENCH_OUT=$OUTDIR PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-390}
SMOKE_ARG=""
[ "${SMOKE:-0}" = "1" ] && SMOKE_ARG="--smoke"
START=$(date +%s)
LOG=$OUTDIR/bench.log
FAILED=""

bench() {  # bench NAME LIMIT_S MODULE ARGS...
  local name=$1 limit=$2 mod=$3; shift 3
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$left" -lt 30 ]; then echo "=== $name SKIPPED (budget: ${left}s left)" | tee -a "$LOG"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name: $PY -m $mod $* $SMOKE_ARG (limit ${limit}s, $(date -u +%H:%M:%S))" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$PY" -m "$mod" "$@" $SMOKE_ARG 2>&1 | grep --line-buffered -v -e '^\[transformers\]' \
    -e 'Writing model shards' -e 'Loading weights' | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && FAILED="$FAILED $name"
  return 0
}

# the HTTP benchmark needs fastapi/uvicorn/openai; the GPU image lacks them: install from carried wheels
if [ -d .device-wheels ] && ! "$PY" -c "import fastapi, uvicorn, openai, prometheus_client" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --find-links .device-wheels fastapi uvicorn pydantic openai prometheus-client \
    2>&1 | tail -3 | tee -a "$LOG"
fi
{ echo "run_all $(date -u) budget ${BUDGET_S}s"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>/dev/null; } | tee -a "$LOG"
bench ceilings 25 benchmarks.ceilings
bench decode_dsv32 125 benchmarks.decode_bench --model dsv32 --profile
# the same step with the FP8 weights widened instead of W8A8 (the dequantized reference's numerics), for the ratio
bench decode_dsv32_weight_only 60 benchmarks.decode_bench --model dsv32 --batches 1,8 --contexts 4096 --fp8-activations weight-only
bench throughput_qwen3 100 benchmarks.throughput_bench --model qwen3 --hf-max-time 30
bench load 45 benchmarks.load_bench
bench load_moe 150 benchmarks.load_bench --model dsv32-fp8 --sources raw,layout,layout-generic,layout-8workers
bench decode_qwen3 45 benchmarks.decode_bench --model qwen3
bench prefill 60 benchmarks.prefill_bench
bench throughput_dsa 90 benchmarks.throughput_bench --model dsa --hf-max-time 30
bench http_qwen3 120 benchmarks.throughput_bench --model qwen3 --http --clients 64
echo "run_all done in $(( $(date +%s) - START ))s${FAILED:+; failed:$FAILED}" | tee -a "$LOG"
[ -z "$FAILED" ]
