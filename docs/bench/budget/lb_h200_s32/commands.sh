# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The thirty-second session, one nvidia-h200 start, one call: bash gpu_lb.sh
# gpu_old/: git archive b2d1767 shardc benchmarks | tar -x -C gpu_old

# gpu_lb.sh
# s32 (issue 22): the largest-batch goal with recompute per saved activation (the working tree) against main before it
# (gpu_old/: git archive b2d1767 shardc benchmarks), one H200, 1b, 8 layers, seq 2048, world 1, expandable segments;
# each row its own torchrun, 5 timed steps after 2: FSDP2-AC-closs 360, new 540, old 540, FSDP2-AC-closs 360 again, new 600.
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
ROOT=$PWD
one() { # name dir batch mode [env...]
  local n=$1 d=$2 b=$3 m=$4; shift 4
  echo "== $n $(date +%T)"
  ( cd $d && env PYTHONPATH=$d "$@" timeout 190 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps 5 --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n ) > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one closs360 $ROOT 360 fsdp2-compile-ac-closs
one new540 $ROOT 540 shardc-budget SHARDC_PEAK_BUDGET=122000000000 SHARDC_LOG=info
one old540 $ROOT/gpu_old 540 shardc-budget SHARDC_PEAK_BUDGET=122000000000 SHARDC_LOG=info
one closs360b $ROOT 360 fsdp2-compile-ac-closs
one new600 $ROOT 600 shardc-budget SHARDC_PEAK_BUDGET=130000000000 SHARDC_LOG=info
cd $OUT && tar czf c1.tgz r && rm -rf r
