# s70 call 1 (issues 18 and 20): is pack_blocks=True fit to be the default? Main's code, one GPU.
# (1) cold first step of default shardc (per-parameter reads) and packed at 8 and 32 layers, and
# both warm at 32 (a second process reusing the cold run's caches); (2) steady steps at 16 layers,
# batch 1 and 4, bound / shardc / shardc-packed, two interleaved rounds in one process.
source docs/bench/s61_not_run/prelude.sh
(timeout 60 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 --pack-blocks \
  --out $R/warm > $R/warm.log 2>&1; echo "throwaway rc=$? $(date +%T)"); rm -rf $R/warm
B="--nproc 1 --model 1b --steps 3 --timeout-s 120 --no-prime"
run u8 8 70 shardc cold
run p8 8 70 shardc-packed cold
run u32 32 150 shardc "cold warm"
run p32 32 150 shardc-packed "cold warm"
rows u8 p8 u32 p32 > $R/rows.txt 2>&1; cut -c1-400 $R/rows.txt
(timeout 330 python3 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 1 4 \
  --modes bound shardc shardc-packed --steps 15 --warmup 3 --rounds 2 --profile-steps 1 \
  --out $R --name so16 > $R/so16.log 2>&1; echo "so16 rc=$? $(date +%T)")
grep -E "^\| *(1|4|16) " $R/so16.md | head -30
cd $OUT && tar czf call1.tgz r && rm -rf r
