# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# One nvidia-h200-x2 machine start, 5 calls (2026-11-30, twenty-fifth session); calls 3-4 in ../../predict/s25_fit10/commands.sh, call 2 in ../b4_chunks_h200_s25/commands.sh
# The combined curve (curve.md/png/svg, curve_rows.json) from merge_curve.py over ../curve_wide_2xh200_s24 and call1/, call5/

# gpu_1.sh
# s25 call 1 (issue 22): the wide config (8 layers, batch 2 x 2048 per GPU) on two H200s at the 17.93 GiB budget where the optimizer step's peak put state on the host (now: the step in chunks), with FSDP2 compiled blocks beside it, then the three FSDP2 baselines the s24 curve lacked (selective AC, activation_memory_budget 0.5, CPUOffloadPolicy), each its own torchrun
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== wide $(date +%T)"
timeout 580 python3 benchmarks/budget_sweep.py --nproc 2 --model wide --budgets 19252321048 --baselines fsdp2-compile fsdp2-compile-sac fsdp2-compile-amb0.5 fsdp2-compile-offload --deadline-s 560 --run-estimate-s 60 --run-timeout-s 220 --out s25_wide -- --n-layers 8 > $R/sweep_wide.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| |^- " s25_wide/curve.md | cut -c1-250
cp -r s25_wide $R/
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_5.sh
# s25 call 5 (issue 22): shardc sharded with shardc.OffloadPolicy() (parameter shards, gradients and optimizer state on the host) on two H200s, wide 8 layers batch 2, under budgets below FSDP2 + CPUOffloadPolicy's measured 6.23 GiB (call 1), each its own torchrun
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload $(date +%T)"
timeout 420 python3 benchmarks/budget_sweep.py --nproc 2 --model wide --no-sweep --offload-budgets 6500000000 5500000000 --deadline-s 400 --run-estimate-s 150 --run-timeout-s 240 --out s25_wide_off -- --n-layers 8 > $R/sweep_off.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| |^- " s25_wide_off/curve.md | cut -c1-250; tail -5 $R/sweep_off.log | cut -c1-400
cp -r s25_wide_off $R/
cd $OUT && tar czf c5.tgz r && rm -rf r
