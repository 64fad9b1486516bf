# s78 call 2 (issue 18): the rows of s74's call 1 on main after s77 (nothing on the plain path
# changed since s74, so this is a further sample of the same code's spread): default shardc cold
# at 8 / 32 / 64 layers, warm at 32, FSDP2 + per-block compile at 32 layers, in two rounds of
# reversed order, after a throwaway process (the machine's first process is slow, s68).
source docs/bench/s61_not_run/prelude.sh
(timeout 60 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 \
  --out $R/warm > $R/warm.log 2>&1; echo "throwaway rc=$? $(date +%T)"); rm -rf $R/warm
B="--nproc 1 --model 1b --steps 3 --timeout-s 120 --no-prime"
run s8a 8 70 shardc cold
run s32a 32 150 shardc "cold warm"
run f32a 32 70 fsdp2-compile cold
run s64a 64 100 shardc cold
run f32b 32 70 fsdp2-compile cold
run s32b 32 80 shardc cold
run s8b 8 70 shardc cold
rows s8a s32a f32a s64a f32b s32b s8b > $R/rows.txt 2>&1; cut -c1-400 $R/rows.txt
cd $OUT && tar czf call2.tgz r && rm -rf r
