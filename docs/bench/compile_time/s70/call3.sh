# s70 call 3 (issue 18): the default configuration after pack_blocks became the default (and the
# reuse key's identity pattern): default shardc cold at 8 / 32 / 64 layers, warm at 32, and FSDP2
# + per-block compile at 32, 8 and 32 layers in two alternated rounds, 64 layers and FSDP2 once; then the steady
# peaks, allocated and reserved, of default shardc against pack_blocks=False at 16 layers
# (s55/s56: packed blocks reserved 2-5% more at world 1, the block-sized gradient).
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
rows s8a s32a f32a s64a s32b s8b > $R/rows.txt 2>&1; cut -c1-300 $R/rows.txt
(timeout 200 python3 benchmarks/train_bench.py --model 1b --n-layers 16 --modes shardc \
  shardc-unpacked --steps 8 --warmup 3 --out $R --name tb16 > $R/tb16.log 2>&1; echo "tb16 rc=$?")
grep -E "^\| *(shardc|1b)" $R/tb16.md | head -8
cd $OUT && tar czf call3.tgz r && rm -rf r
