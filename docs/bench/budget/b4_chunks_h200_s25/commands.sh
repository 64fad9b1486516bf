# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Call 2 of the machine start in ../curve_wide_2xh200_s25/commands.sh

# gpu_2.sh
# s25 call 2 (issue 22): the 1b config (8 layers, batch 4 x 2048) on ONE H200 of the two-GPU machine (CUDA_VISIBLE_DEVICES=0) at the three budgets of the thirteenth session's b4_low run (at and below FSDP2-AC's measured peak; there the optimizer state went to the host), now with the optimizer step in chunks, and FSDP2 + full AC beside them, each its own torchrun
source gpu_env.sh
export CUDA_VISIBLE_DEVICES=0
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== 1b $(date +%T)"
timeout 580 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b --budgets 10909216932 10630043058 10307921510 --baselines fsdp2-compile-ac --deadline-s 560 --run-estimate-s 70 --run-timeout-s 200 --out s25_1b -- --n-layers 8 > $R/sweep_1b.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| |^- " s25_1b/curve.md | cut -c1-250
cp -r s25_1b $R/
cd $OUT && tar czf c2.tgz r && rm -rf r
