# Issue 20, 2 GPUs: the wide config at batch 4. Issue 18, 2 GPUs: the cold first step of the
# 1b config at 8, 32 and 64 layers and FSDP2 + per-block compile at 32, each row its own pair
# of processes with empty Inductor/Triton caches, after a throwaway process.
source docs/bench/next_x2/common.sh
tb wide 4 x2_wide_b4 200 bound shardc shardc-cudagraphs fsdp2-compile simplefsdp fsdp2
B="--nproc 2 --model 1b --steps 3 --timeout-s 120 --no-prime"
(timeout 60 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 \
  --out $R/warm > $R/warm.log 2>&1; echo "throwaway rc=$? $(date +%T)"); rm -rf $R/warm
run c8 8 80 shardc cold
run c32 32 100 shardc cold
run f32 32 80 fsdp2-compile cold
run c64 64 120 shardc cold
rows c8 c32 f32 c64 > $R/rows.txt 2>&1; cut -c1-400 $R/rows.txt
cd $OUT && tar czf callC.tgz r && rm -rf r
