# s70 call 2 (same H100, warm after call 1): 32 layers at batch 1, where s53 had measured packed
# blocks 9% slower than the per-parameter reads on an H200; default shardc against
# shardc-packed, three interleaved rounds in one process (bound left out: the three models do
# not fit 80 GB together).
source docs/bench/s61_not_run/prelude.sh
(timeout 400 python3 benchmarks/step_overhead.py --model 1b --n-layers 32 --batch 1 \
  --modes shardc shardc-packed --steps 15 --warmup 3 --rounds 3 --profile-steps 1 \
  --out $R --name so32b1 > $R/so32b1.log 2>&1; echo "so32b1 rc=$? $(date +%T)")
sed -n 5,30p $R/so32b1.md
cd $OUT && tar czf call2.tgz r && rm -rf r
