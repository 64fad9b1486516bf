# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_2.sh (call 2)
# s22 call 2 (issue 22): the wide config's CPU-offload points on one H200 with world 1's collectives elided under offload (off22): auto and two budgets below it, beside FSDP2 + CPUOffloadPolicy, fused AdamW in both
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto 6.69e9 6.2e9 --baselines fsdp2-compile-offload --run-timeout-s 125 --out $R/offload_wide_s22 -- --n-layers 8 --optim-impl fused > $R/offload_wide_s22.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (shardc|fsdp2)" $R/offload_wide_s22/curve.md | cut -c1-220
tail -5 $R/offload_wide_s22.log | cut -c1-250
cd $OUT && tar czf c2.tgz r && rm -rf r
