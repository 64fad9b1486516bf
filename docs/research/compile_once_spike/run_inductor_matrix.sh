#!/bin/bash
# Cold Inductor first step, 1-rank gloo, CPU: today's path vs Design A (region_out_hash with the
# body-recompute and alias-rewiring prototype), 2 and 16 blocks; then a warm rerun (same cache dir).
# Usage: bash scratch/run_inductor_matrix.sh OUTDIR
out=${1:-/tmp/s18/indm}; mkdir -p $out
py=/work/main/.venv/bin/python
for L in 2 16; do
  for mode in plain region_out_hash; do
    rm -rf $out/cache_${mode}_$L
    TORCHINDUCTOR_CACHE_DIR=$out/cache_${mode}_$L BODY_RECOMPUTE=1 PYTHONPATH=$PWD timeout 600 \
      $py scratch/exp_compile.py --layers $L --mode $mode --inductor > $out/${mode}_$L.json 2>&1
  done
done
for mode in plain region_out_hash; do
  TORCHINDUCTOR_CACHE_DIR=$out/cache_${mode}_16 BODY_RECOMPUTE=1 PYTHONPATH=$PWD timeout 600 \
    $py scratch/exp_compile.py --layers 16 --mode $mode --inductor > $out/${mode}_16_warm.json 2>&1
done
