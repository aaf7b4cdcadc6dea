#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, in one command (the GPU machine starts bare each time).
# From the repo root on a CUDA machine, with .device-wheels carried (see ../shared/device/README.md; fetch them
# with `../shared/device/wheels.sh .device-wheels prometheus-client hypothesis pytest-timeout xgrammar`: xgrammar
# for structured outputs, tests/gpu/test_structured_outputs_gpu.py, which is skipped without it):
#   OUT=/some/dir scripts/gpu_session.sh            # GPU test suite, then the issue-7 benchmarks
# Writes gpu/summary.md, gpu/pytest.log, bench/bench.log, bench/results.jsonl under $OUT.
set -u
OUT=${OUT:-gpu-session}
mkdir -p "$OUT/gpu" "$OUT/bench"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --find-links .device-wheels fastapi uvicorn pydantic openai prometheus-client \
  hypothesis pytest-timeout 2>&1 | tail -2
python3 -m pip install -q --no-index --find-links .device-wheels --no-deps xgrammar apache-tvm-ffi 2>&1 | tail -1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
timeout -k 5 "${TEST_LIMIT_S:-270}" python3 scripts/run_gpu_tests.py --out "$OUT/gpu" -- -q -p no:cacheprovider
echo "gpu tests rc=$?"
BUDGET_S=${BENCH_BUDGET_S:-250} ONLY="${ONLY:-ceilings decode_dsv32 throughput_qwen3 load}" \
  benchmarks/run_all.sh "$OUT/bench"
