# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Calls 3-5 of the machine start in ../curve_1b_2xh200_s24/commands.sh (same code)

# gpu_3.sh
# s24 call 3 (issue 22): the wide config budget curve (8 layers, batch 2 x 2048 per GPU) then its FSDP2 baselines on two H200s (compiled blocks alone, full and selective activation checkpointing, activation_memory_budget 0.5, CPUOffloadPolicy), each its own torchrun,
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== baselines $(date +%T)"
timeout 575 python3 benchmarks/budget_sweep.py --nproc 2 --model wide --count 8 --baselines --deadline-s 565 --run-estimate-s 60 --run-timeout-s 200 --out s24_curve_wide -- --n-layers 8 > $R/sweep_wide_part1.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " s24_curve_wide/curve.md | cut -c1-230
cp -r s24_curve_wide $R/
cd $OUT && tar czf c3.tgz r && rm -rf r

# gpu_4.sh
# s24 call 4 (issue 22): the rest of the wide config budget curve (call 3 ran 3 budgets and auto before its deadline) then its FSDP2 baselines on two H200s (compiled blocks alone, full and selective activation checkpointing, activation_memory_budget 0.5, CPUOffloadPolicy), each its own torchrun,
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== baselines $(date +%T)"
timeout 575 python3 benchmarks/budget_sweep.py --nproc 2 --model wide --count 8 --baselines --deadline-s 555 --run-estimate-s 55 --run-timeout-s 200 --out s24_curve_wide -- --n-layers 8 > $R/sweep_wide_part2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " s24_curve_wide/curve.md | cut -c1-230
cp -r s24_curve_wide $R/
cd $OUT && tar czf c4.tgz r && rm -rf r

# gpu_5.sh
# s24 call 5 (issue 22): the wide curve's FSDP2 baseline with full activation checkpointing (call 4 reached only fsdp2-compile) on two H200s (compiled blocks alone, full and selective activation checkpointing, activation_memory_budget 0.5, CPUOffloadPolicy), each its own torchrun,
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== baselines $(date +%T)"
timeout 135 python3 benchmarks/budget_sweep.py --nproc 2 --model wide --count 8 --no-sweep --baselines fsdp2-compile-ac --run-timeout-s 125 --out s24_curve_wide -- --n-layers 8 > $R/sweep_wide_part3.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " s24_curve_wide/curve.md | cut -c1-230
cp -r s24_curve_wide $R/
cd $OUT && tar czf c5.tgz r && rm -rf r
