# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Call 1 of the session (nvidia-h200-x2 start): GPU 0 ran gpu0() (the largest-batch rows in beside_host_adamw/), GPU 1 gpu1() (../chunk_price_h200_s26, ../offload_wide_h200_s26/call1)
# s26 call 1 (issue 22), one nvidia-h200-x2 start, the two GPUs used as two one-GPU machines at once.
# GPU 0: the largest-batch goal (1b, 8 layers, seq 2048, world 1, expandable segments): FSDP2-AC with a compiled loss at its largest batch (360)
#        beside shardc at 540 (1.5x) under three budgets (122e9: last session's; 100e9 and 85e9: more checkpoints on the host, headroom for the allocator).
# GPU 1: the optimizer step in chunks priced alone (1b b4, a budget that binds nothing, chunks always vs never), then the wide config's CPU-offload
#        points at world 1 (shardc.OffloadPolicy under 7.1e9 / 7.0e9 / 6.9e9 B beside FSDP2 + CPUOffloadPolicy, fused AdamW, 15 timed steps).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # gpu name batch steps mode [env...]
  local g=$1 n=$2 b=$3 s=$4 m=$5; shift 5
  echo "== $n $(date +%T)"
  env CUDA_VISIBLE_DEVICES=$g "$@" timeout 170 torchrun --master-port $((29500+g)) --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
gpu0() {
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  one 0 closs360 360 4 fsdp2-compile-ac-closs
  one 0 sh540_100 540 4 shardc-budget SHARDC_PEAK_BUDGET=100000000000
  one 0 sh540_85 540 4 shardc-budget SHARDC_PEAK_BUDGET=85000000000
  one 0 sh540_122 540 4 shardc-budget SHARDC_PEAK_BUDGET=122000000000
}
gpu1() {
  one 1 b4_never 4 10 shardc-budget SHARDC_PEAK_BUDGET=100000000000 SHARDC_OPTIMIZER_STEP_CHUNKS=never
  one 1 b4_always 4 10 shardc-budget SHARDC_PEAK_BUDGET=100000000000 SHARDC_OPTIMIZER_STEP_CHUNKS=always
  echo "== wide offload $(date +%T)"
  CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29601 timeout 330 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets 7.1e9 7.0e9 6.9e9 --baselines fsdp2-compile-offload --run-timeout-s 110 --out $R/offload_wide_s26 -- --n-layers 8 --optim-impl fused --steps 15 > $R/offload_wide_s26.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| (shardc|fsdp2)" $R/offload_wide_s26/curve.md | cut -c1-220
}
( timeout 570 bash -c "$(declare -f one gpu0); R=$R; gpu0" ) > $R/gpu0.out 2>&1 &
gpu1 > $R/gpu1.out 2>&1
wait
cat $R/gpu0.out $R/gpu1.out
cd $OUT && tar czf c1.tgz r && rm -rf r

# Calls 3 and 4 (one nvidia-h200 start): gpu_3.sh as below for call 3; call 4 ran closs360 then sh540_122 (the sed in the run's command commented out the others) into repeat/
# s26 call 3 (issue 22): the largest-batch goal again, alone on one H200 (call 1 ran it beside a host-AdamW-bound run on the other GPU of the same host:
# its shardc row shared the host's memory bandwidth with that run's host AdamW). 1b, 8 layers, seq 2048, world 1, expandable segments; each row its own torchrun.
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # name batch steps mode [env...]
  local n=$1 b=$2 s=$3 m=$4; shift 4
  echo "== $n $(date +%T)"
  env "$@" timeout 200 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one sh540_122 540 5 shardc-budget SHARDC_PEAK_BUDGET=122000000000
one closs360 360 5 fsdp2-compile-ac-closs
one sh600_auto 600 4 shardc-budget SHARDC_PEAK_BUDGET=auto
cd $OUT && tar czf c3.tgz r && rm -rf r
