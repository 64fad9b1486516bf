source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
one() { # name batch mode [env]
  local n=$1 b=$2 m=$3; shift 3
  echo "== $n $(date +%T)"
  env "$@" timeout 200 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps 2 --warmup 1 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-400
  free -g | head -2
}
one ck600 600 shardc-budget SHARDC_PEAK_BUDGET=auto
one closs360 360 fsdp2-compile-ac-closs
one ck640 640 shardc-budget SHARDC_PEAK_BUDGET=auto
one ck480 480 shardc-budget SHARDC_PEAK_BUDGET=auto
cd $OUT && tar czf ck.tgz r && rm -rf r
