# gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6)
# The thirty-third session, nvidia-h200 starts; calls 2 and 5 are the ones whose results are kept here.

# gpu_t2.sh (call 2: the lever's GPU test with a budget too low, then 1b rows; auto3 failed there, see call2/auto3_failed.log)
# s33 call 2 (issue 22): the planner-chosen parameter offload on the 1b config (8 layers, batch 4, seq 2048, world 1, one H200):
# budgets below the device levers' floor (the s28 curve's smallest accepted, 4.67 GiB, has every optimizer state on the host),
# each row its own torchrun (3 timed steps after 1): shardc-budget with SHARDC_PARAM_OFFLOAD=auto (OffloadPolicy(params="auto"))
# at 3.0e9, shardc-offload-budget (OffloadPolicy() at shard time, step_in_backward) at 3.0e9, then at 12e9 (met on the device)
# auto against plain shardc-budget; first the GPU test of the lever again (budget 1.6x the shards).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
one() { # name timeout mode [env...]
  local n=$1 t=$2 m=$3; shift 3
  echo "== $n $(date +%T)"
  ( env "$@" SHARDC_LOG=info timeout $t torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch 4 \
    --modes $m --steps 3 --warmup 1 --profile-steps 0 --no-dump-plan --out $R --name $n ) > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error|moves the parameter" $R/$n.log | tail -3 | cut -c1-300
}
echo "== auto tests $(date +%T)"
timeout 120 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_offload_gpu.py -k moves_the_shards > $R/auto.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "auto offload|passed|failed|Error" $R/auto.log | tail -8 | cut -c1-400
one auto3 170 shardc-budget SHARDC_PEAK_BUDGET=3000000000 SHARDC_PARAM_OFFLOAD=auto
one off3 140 shardc-offload-budget SHARDC_PEAK_BUDGET=3000000000
one auto12 80 shardc-budget SHARDC_PEAK_BUDGET=12000000000 SHARDC_PARAM_OFFLOAD=auto
one dev12 80 shardc-budget SHARDC_PEAK_BUDGET=12000000000
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_t4.sh (call 5: diag.py, the lever's GPU tests, the 1b row at 3.0e9 again)
# s33 call 5 (issue 22): diag.py (FX) after the fix of the example inputs' swap, the GPU tests of the lever, then the 1b row at 3.0e9 with SHARDC_PARAM_OFFLOAD=auto
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
timeout 120 python3 diag.py > $R/diag_fx.log 2>&1; echo "fx rc=$?"; grep -v "^\s*$" $R/diag_fx.log | grep -v "Warning\|^  node\|^  leaf\|^\[rank0\]:  " | tail -16 | cut -c1-300
echo "== auto tests $(date +%T)"
timeout 150 python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/gpu/test_offload_gpu.py -k moves_the_shards > $R/auto.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "auto offload|passed|failed|Error" $R/auto.log | tail -8 | cut -c1-400
echo "== auto3 $(date +%T)"
( env SHARDC_PEAK_BUDGET=3000000000 SHARDC_PARAM_OFFLOAD=auto SHARDC_LOG=info timeout 170 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch 4 \
    --modes shardc-budget --steps 3 --warmup 1 --profile-steps 0 --no-dump-plan --out $R --name auto3 ) > $R/auto3.log 2>&1
echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error|moves the parameter" $R/auto3.log | tail -3 | cut -c1-300
cd $OUT && tar czf c5.tgz r && rm -rf r
