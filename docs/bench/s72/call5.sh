# s72 call 5 (issue 20, world 1): the 16-layer row again, two interleaved rounds in one process
# (run as one inline command on the device; this file records it).
source docs/bench/s61_not_run/prelude.sh
timeout 200 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 4 --modes bound shardc shardc-budget \
  --steps 15 --warmup 3 --rounds 2 --profile-steps 1 --top 12 --out $R --name so16b4r2 > $R/so16b4r2.log 2>&1; echo "so16r2 rc=$? $(date +%T)"
grep -E "^\| 1b" $R/so16b4r2.md | head -9; cd $OUT && tar czf call5.tgz r && rm -rf r
