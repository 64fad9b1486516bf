source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
echo "== shardc $(date +%T)"
python3 benchmarks/largest_batch.py --model 1b --modes shardc-budget --start 480 --max-batch 960 \
  --max-tries 3 --steps 2 --run-timeout-s 200 --deadline-s 250 --try-estimate-s 90 --out $R -- --n-layers 8 2>&1 | tail -5
echo "== fsdp2 $(date +%T)"
python3 benchmarks/largest_batch.py --model 1b --modes fsdp2-compile-ac-closs --resume --start 360 --max-batch 720 \
  --max-tries 4 --steps 2 --run-timeout-s 150 --deadline-s 270 --try-estimate-s 55 --out $R -- --n-layers 8 2>&1 | tail -5
echo "== done $(date +%T)"
cat $R/largest_batch.md
cd $OUT && tar czf lb2.tgz r && rm -rf r
