# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_4.sh (call 4, one nvidia-h200 start; ran main 8d3fc28's code: the device's .git named 9f8050e with modified files, and the diff's hash equals git diff 9f8050e 8d3fc28 over them: commit.txt)
# s23 call 4 (issue 22): the wide config's CPU-offload points at world 1 with the levers together (trade23: blocks recomputed so that buckets stay gathered), 6.69e9 and 6.2e9 B, beside FSDP2 + CPUOffloadPolicy, 15 timed steps each, fused AdamW (the decisions in the log rows)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets 6.69e9 6.2e9 --baselines fsdp2-compile-offload --run-timeout-s 140 --out $R/offload_wide_trade -- --n-layers 8 --optim-impl fused --steps 15 > $R/offload_wide_trade.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (shardc|fsdp2)" $R/offload_wide_trade/curve.md | cut -c1-220
grep -A4 "^budget B" $R/offload_wide_trade.log | cut -c1-260
cd $OUT && tar czf c4.tgz r && rm -rf r
