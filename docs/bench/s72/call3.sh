# s72 call 3 (issue 20, world 1): call 1's 16-layer row at 8 and 32 layers: the bound, shardc
# (packed default, every bucket resharded after the forward) and shardc-budget (the planner
# keeps buckets gathered under the "auto" budget), one process per depth, batch 4.
source docs/bench/s61_not_run/prelude.sh
for L in 8 32; do
timeout 230 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers $L --batch 4 --modes bound shardc shardc-budget \
  --steps 15 --warmup 3 --rounds 1 --profile-steps 2 --top 24 --out $R --name so${L}b4 > $R/so${L}b4.log 2>&1; echo "so$L rc=$? $(date +%T)"
grep -E "^\| 1b" $R/so${L}b4.md | head -3; done
cd $OUT && tar czf call3.tgz r && rm -rf r
