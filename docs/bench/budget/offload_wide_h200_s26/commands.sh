# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# call1/: gpu1() of ../lb_h200_s26/commands.sh (nvidia-h200-x2, GPU 1, while GPU 0 ran the largest-batch rows); its FSDP2 baseline did not finish within the 330 s limit
# call2/ (same x2 start, GPU 1 alone):
source gpu_env.sh; R=$OUT/r; mkdir -p $R; git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets 6.9e9 7.0e9 --baselines fsdp2-compile-offload --run-timeout-s 150 --out $R/offload_wide_s26b -- --n-layers 8 --optim-impl fused --steps 15 > $R/offload_wide_s26b.log 2>&1
# call5/ (one nvidia-h200 start, the session's third):
# s26 call 5 (issue 22): the wide config's CPU-offload point at world 1, one H200: does the host AdamW's thread count explain shardc's spread?
# shardc.OffloadPolicy under 7.0e9 B (every bucket kept, 4 blocks recomputed) and FSDP2 + CPUOffloadPolicy, fused AdamW, 12 timed steps,
# with OMP_NUM_THREADS=15 (one of the 16 cores left to the thread that launches the device's work) and with torch's default (16).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
one() { # name mode [env...]
  local n=$1 m=$2; shift 2
  echo "== $n $(date +%T)"
  env "$@" timeout 110 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model wide --n-layers 8 --batch 2 --optim-impl fused \
    --modes $m --steps 12 --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one sh70_omp15 shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000 OMP_NUM_THREADS=15
one fsdp2_omp15 fsdp2-compile-offload OMP_NUM_THREADS=15
one sh70 shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000
one fsdp2 fsdp2-compile-offload
cd $OUT && tar czf c5.tgz r && rm -rf r
