#!/usr/bin/env bash
# The 2-GPU training benchmark (issue 7) through the device tool, on nvidia-h200-x2:
#   bash scripts/gpu_bench.sh            # both models, every mode, results under $OUT/bench
# DEADLINE_S bounds the run (modes that would not finish in time are skipped and say so).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-out/gpu_bench}"
mkdir -p "$OUT_DIR/bench"
# NVLink multicast stays off on the shared hosts (see the device tool's KINDS.md).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m torch.distributed.run --nproc-per-node "${NPROC:-2}" benchmarks/train_bench.py \
    --model "${MODEL:-both}" --modes ${MODES:-shardc bound fsdp2 fsdp2-compile simplefsdp shardc-pool} \
    --memory-snapshot --deadline-s "${DEADLINE_S:-500}" --out "$OUT_DIR/bench" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT_DIR/bench.log"
