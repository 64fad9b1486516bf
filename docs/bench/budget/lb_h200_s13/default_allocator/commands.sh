source gpu_env.sh
R=$OUT/r; mkdir -p $R
one() { # name batch mode [env]
  local n=$1 b=$2 m=$3; shift 3
  echo "== $n $(date +%T)"
  env "$@" timeout 170 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps 2 --warmup 1 --profile-steps 0 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error|error" $R/$n.log | tail -3
}
one lb480 480 shardc-budget SHARDC_PEAK_BUDGET=auto
one closs300 300 fsdp2-compile-ac-closs
one lb450 450 shardc-budget SHARDC_PEAK_BUDGET=auto
one lb320 320 shardc-budget SHARDC_PEAK_BUDGET=auto
cd $OUT && tar czf lb.tgz r && rm -rf r
