# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# call 2 of the session (the same nvidia-h200 start as ../offload_wide_h200_s27, after call 1), gpu_2.sh:
# s27 call 2 (issue 22): the largest-batch goal on another start, alone on one H200 (same machine start as call 1, after it).
# 1b, 8 layers, seq 2048, world 1, expandable segments; each row its own torchrun; FSDP2-AC-closs first, shardc between two FSDP2 rows.
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
one closs360 360 5 fsdp2-compile-ac-closs
one sh540_122 540 5 shardc-budget SHARDC_PEAK_BUDGET=122000000000
one closs360b 360 5 fsdp2-compile-ac-closs
cd $OUT && tar czf c2.tgz r && rm -rf r
