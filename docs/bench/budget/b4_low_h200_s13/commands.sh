source gpu_env.sh
R=$OUT/r; mkdir -p $R
python3 benchmarks/budget_sweep.py --nproc 1 --model 1b --budgets 10909216932 10630043058 10307921510 \
  --baselines fsdp2-compile-ac --deadline-s 480 --run-estimate-s 70 --run-timeout-s 150 --out $R -- --n-layers 8 2>&1 | tail -30
cat $R/curve.md 2>/dev/null | head -40
cd $OUT && tar czf b4.tgz r && rm -rf r
