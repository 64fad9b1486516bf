# s72 call 4 (issue 20, world 1): the 8-layer row again, three interleaved rounds in one process.
source docs/bench/s61_not_run/prelude.sh
timeout 250 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 4 --modes bound shardc shardc-budget \
  --steps 15 --warmup 3 --rounds 3 --profile-steps 1 --top 12 --out $R --name so8b4r3 > $R/so8b4r3.log 2>&1; echo "so8r3 rc=$? $(date +%T)"
grep -E "^\| 1b" $R/so8b4r3.md | head -9
cd $OUT && tar czf call4.tgz r && rm -rf r
