# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# call 1 of the session (one nvidia-h200 start), gpu_1.sh:
# s27 call 1 (issues 21/22): the gradient-copy release fix (10acbb9) on a GPU: the offload GPU tests, then the wide config's
# world-1 CPU-offload point beside FSDP2 + CPUOffloadPolicy and beside shardc without offload (the loss reference), fused AdamW, 12 timed steps.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
echo "== pytest $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/pytest_offload_gpu.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/pytest_offload_gpu.log
one() { # name mode [env...]
  local n=$1 m=$2; shift 2
  echo "== $n $(date +%T)"
  env "$@" timeout 110 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model wide --n-layers 8 --batch 2 --optim-impl fused \
    --modes $m --steps 12 --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one sh70 shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000
one fsdp2 fsdp2-compile-offload
one shardc_nooff shardc
one sh70b shardc-offload-budget SHARDC_PEAK_BUDGET=7000000000
cd $OUT && tar czf c1.tgz r && rm -rf r
