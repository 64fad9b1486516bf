# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Calls 1 and 2 of the twenty-eighth session (one nvidia-h200-x2 start): gpu_1.sh twice (the second run went on where the first's deadline stopped; the wide sweep on GPU 0, the 1b sweep ../curve_1b_h200_s28 on GPU 1). Call 3 (host_alone/, one nvidia-h200 start): gpu_3.sh

# gpu_1.sh
# s28 call 1 (and call 2: the same script again) (issue 22): the one-GPU budget curves with the current planner, one nvidia-h200-x2 start, its two GPUs used as two one-GPU machines at once.
# GPU 0: wide, 8 layers, batch 2 x 2048, world 1; GPU 1: 1b, 8 layers, batch 4 x 2048, world 1. Budgets from CPU plans (python -m shardc plan ... --memory-budget 1 / auto,
# --profile h200, check_host_memory off): 8 evenly from the smallest accepted to the auto plan's peak x 1.02, one a byte below the smallest, auto; then shardc.OffloadPolicy
# (wide) and the five FSDP2 baselines. Ascending budgets on both GPUs, so that the host-bound rows (optimizer state on the host) of the two sweeps run at about the same time.
# Each row its own torchrun; torch's default AdamW everywhere. The same script again (call 2) goes on where the deadline stopped it (rows already run are skipped).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
DL=${DL:-530}
( CUDA_VISIBLE_DEVICES=0 PET_MASTER_PORT=29500 timeout 575 python3 benchmarks/budget_sweep.py --nproc 1 --model wide \
    --budgets 16204284149 16204284150 19383090989 22561897828 25740704668 28919511507 32098318347 35277125186 38455932026 auto \
    --offload-budgets 7.0e9 --baselines --deadline-s $DL --run-estimate-s 70 --run-timeout-s 200 --out s28_wide -- --n-layers 8 ) > $R/sweep_wide.log 2>&1 &
( CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29601 timeout 575 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b \
    --budgets 5010186731 5010186732 6192299783 7374412834 8556525885 9738638937 10920751988 12102865039 13284978091 auto \
    --baselines --deadline-s $DL --run-estimate-s 60 --run-timeout-s 200 --out s28_1b -- --n-layers 8 ) > $R/sweep_1b.log 2>&1 &
wait
for m in wide 1b; do echo "== $m"; grep -E "^\{" $R/sweep_$m.log | cut -c1-200; grep -E "stopped|Traceback" $R/sweep_$m.log | head -3; done
cp -r s28_wide s28_1b $R/
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_3.sh
# s28 call 3 (issue 22): the wide config's host-bound rows at world 1 again, each alone on one GPU (calls 1-2 ran them while the other GPU's sweep
# ran its own host-bound rows on the same host). FSDP2 + CPUOffloadPolicy first, then shardc.OffloadPolicy under 7e9 B, then the budgets whose plans
# put part or all of the optimizer's state on the host, high to low. Each row its own torchrun, torch's default AdamW, 3 timed steps after 2.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
S="python3 benchmarks/budget_sweep.py --nproc 1 --model wide --steps 3 --run-estimate-s 80 --run-timeout-s 150 --out s28_wide_host"
timeout 120 $S --no-sweep --baselines fsdp2-compile-offload -- --n-layers 8 > $R/sweep_base.log 2>&1
timeout 120 $S --no-sweep --offload-budgets 7.0e9 -- --n-layers 8 > $R/sweep_off.log 2>&1
timeout 340 $S --budgets 28919511507 25740704668 22561897828 16204284150 19383090989 --deadline-s 330 -- --n-layers 8 > $R/sweep_host.log 2>&1
grep -E "^\{" $R/sweep_*.log | cut -c1-160; grep -E "stopped|Traceback" $R/sweep_*.log | head
cp -r s28_wide_host $R/
cd $OUT && tar czf c3.tgz r && rm -rf r
