# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# One nvidia-h200-x2 machine start, calls 1-5 in order; each ran main 9bd3e14 exactly (the device's .git named it; git status listed only these scripts and the carried curve directory; the diff's hash is the empty one's: commit_c*.txt). The scripts wrote into s24_curve_1b / s24_curve_wide (carried from call to call), renamed here.

# gpu_1.sh
# s24 call 1 (issue 22): the 1b config's budget curve on two H200s (world 2, 8 layers, batch 4 x 2048 per GPU): auto, the refused 1-byte budget, then 8 budgets from the smallest accepted to auto's peak (and one below the smallest), each its own torchrun; the rest of the sweep and the FSDP2 baselines follow in call 2 into the same directory
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== sweep $(date +%T)"
timeout 575 python3 benchmarks/budget_sweep.py --nproc 2 --model 1b --count 8 --deadline-s 560 --run-estimate-s 60 --run-timeout-s 200 --out s24_curve_1b -- --n-layers 8 > $R/sweep_part1.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " s24_curve_1b/curve.md | cut -c1-230
cp -r s24_curve_1b $R/
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_2.sh
# s24 call 2 (issue 22): the FSDP2 baselines of the 1b budget curve on two H200s (compiled blocks alone, full and selective activation checkpointing, activation_memory_budget 0.5, CPUOffloadPolicy), each its own torchrun, into call 1's curve directory
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== baselines $(date +%T)"
timeout 575 python3 benchmarks/budget_sweep.py --nproc 2 --model 1b --count 8 --no-sweep --baselines --deadline-s 560 --run-estimate-s 70 --run-timeout-s 200 --out s24_curve_1b -- --n-layers 8 > $R/sweep_part2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " s24_curve_1b/curve.md | cut -c1-230
cp -r s24_curve_1b $R/
cd $OUT && tar czf c2.tgz r && rm -rf r
