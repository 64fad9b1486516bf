# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# call 3 of the session (one nvidia-h200-x2 start; calls 4-5 in ../../predict/s27_h200_preset/commands.sh), gpu_3.sh; s27_old/ was made on the CPU machine with: mkdir -p s27_old && git archive f87531c shardc | tar -x -C s27_old
# s27 call 3 (issues 21/22): what the gradient-copy release (10acbb9) costs, on one nvidia-h200-x2 start, rows side by side, each its own torchrun:
# the wide config (8 layers, batch 2 x 2048 per GPU, fused AdamW on the host, shardc.OffloadPolicy under a peak budget) with main's shardc
# and with the shardc of f87531c (the commit before the fix; s27_old/, from `git archive f87531c shardc`), on two GPUs (6.5e9 B) and on one (7.0e9 B).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
one() { # name nproc mode [env...]
  local n=$1 p=$2 m=$3; shift 3
  echo "== $n $(date +%T)"
  env "$@" timeout 115 torchrun --nproc-per-node $p benchmarks/train_bench.py --model wide --n-layers 8 --batch 2 --optim-impl fused \
    --modes $m --steps 10 --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
OLD="PYTHONPATH=$PWD/s27_old:$PWD"
one w2_new 2 shardc-offload-budget SHARDC_PEAK_BUDGET=6500000000
one w2_old 2 shardc-offload-budget SHARDC_PEAK_BUDGET=6500000000 $OLD
one w2_fsdp2 2 fsdp2-compile-offload
one w1_new 1 shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000
one w1_old 1 shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000 $OLD
cd $OUT && tar czf c3.tgz r && rm -rf r
