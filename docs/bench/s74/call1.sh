# s74 call 1 (issue 18): issue 18's rows on main after s73's passes (the split unpack, the body's
# gradient casts, the returned sizes): default shardc cold at 8 / 32 / 64 layers, warm at 32, and
# FSDP2 + per-block compile at 32 layers, 8 and 32 layers in two alternated rounds (s70's call 3).
source docs/bench/s61_not_run/prelude.sh
(timeout 60 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 \
  --out $R/warm > $R/warm.log 2>&1; echo "throwaway rc=$? $(date +%T)"); rm -rf $R/warm
B="--nproc 1 --model 1b --steps 3 --timeout-s 120 --no-prime"
run s8a 8 70 shardc cold
run s32a 32 150 shardc "cold warm"
run f32a 32 70 fsdp2-compile cold
run s64a 64 100 shardc cold
run s32b 32 80 shardc cold
run s8b 8 70 shardc cold
rows s8a s32a f32a s64a s32b s8b > $R/rows.txt 2>&1; cut -c1-400 $R/rows.txt
cd $OUT && tar czf call1.tgz r && rm -rf r
