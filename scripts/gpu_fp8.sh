#!/usr/bin/env bash
# FP8 on the GPU machine: the GPU tests (pytest -m gpu) and the FP8 vs bf16 benchmark.
# Run from the repository root, e.g. through the device tool:
#   bash scripts/gpu_fp8.sh            # tests + benchmark (d_model 4096, 200 steps, 1 GPU)
#   STEPS=20 bash scripts/gpu_fp8.sh   # shorter benchmark
#   NPROC=2 bash scripts/gpu_fp8.sh    # two GPUs
#   BENCH_ARGS="--modes bf16,fp8,fp8-linear" bash scripts/gpu_fp8.sh   # also FP8 Linears only
# The benchmark's fp8 mode gathers the Linear weights and the token embedding in float8
# (fp8-linear: the Linear weights only); its json/md give all_gather_ratio_vs_bf16.
# Results go to $OUT (the device tool's output folder) or out/gpu_fp8/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out/gpu_fp8}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  "$PY" -m pytest -q -m gpu -rs tests/gpu 2>&1 | tee "$OUT_DIR/gpu_tests.log" || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  "$PY" -m torch.distributed.run --nproc-per-node "${NPROC:-1}" benchmarks/fp8_bench.py \
      --steps "${STEPS:-200}" ${BENCH_ARGS:-} --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/fp8_bench.log" \
      || rc=1
fi
exit $rc
