# Issue 19, 2 GPUs: the wide model's FSDP rows of the matrix (callD's second half), then the
# default shardc configuration (no CUDA graphs, no budget) on the 1b FSDP rows.
source docs/bench/next_x2/common.sh
timeout 300 python3 benchmarks/predict_matrix.py --parts fsdp2-wide \
  --profile shardc/planning/profiles/h200.json --out $R --deadline-s 285 \
  -- --blocks-once --cudagraphs --memory-budget auto --steps 10 > $R/matrix_b.log 2>&1
echo "matrix wide rc=$? $(date +%T)"; tail -12 $R/matrix_b.log | cut -c1-250
mkdir -p $R/default
timeout 240 torchrun --nproc-per-node 2 benchmarks/predict_step.py \
  --profile shardc/planning/profiles/h200.json --configs 1b:8:1,1b:8:2,1b:8:4 --blocks-once \
  --steps 10 --deadline-s 225 --out $R/default --name predict_default_w2 \
  > $R/default/predict_default_w2.log 2>&1
echo "default rc=$? $(date +%T)"; grep -E "^\| " $R/default/predict_default_w2.md | head -8 | cut -c1-220
cd $OUT && tar czf callE.tgz r && rm -rf r
