# before (main 49cc231): call 1
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; nvidia-smi -L >> $R/commit.txt
one() { # name batch mode [env]
  local n=$1 b=$2 m=$3; shift 3
  echo "== $n $(date +%T)"
  env "$@" timeout 240 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps 4 --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error|recomput" $R/$n.log | tail -3 | cut -c1-400
}
one closs240 240 fsdp2-compile-ac-closs
one ac240 240 shardc-ac
one rc240 240 shardc-budget SHARDC_PEAK_BUDGET=80000000000 SHARDC_FUSED_LOSS=0 SHARDC_ACTIVATION_OFFLOAD=never
kd() { # mode [env]
  local m=$1; shift
  echo "== kd $m $(date +%T)"
  env "$@" timeout 150 python3 benchmarks/kernel_diff.py --mode $m --n-layers 3 --batch 16 --out $R/kd > $R/kd_$m.log 2>&1
  echo "rc=$? $(date +%T)"
}
kd fsdp2-compile-ac-closs
kd shardc-ac
kd shardc-budget SHARDC_PEAK_BUDGET=0 "SHARDC_ACTIVATION_OFFLOAD=checkpoint:*"
cd $OUT && tar czf c1.tgz r && rm -rf r

# after (49cc231 + the pruning change, working tree diff sha256 in after/commit.txt): call 2
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # name batch steps mode [env]
  local n=$1 b=$2 s=$3 m=$4; shift 4
  echo "== $n $(date +%T)"
  env "$@" timeout 240 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one rc240 240 4 shardc-budget SHARDC_PEAK_BUDGET=80000000000 SHARDC_FUSED_LOSS=0 SHARDC_ACTIVATION_OFFLOAD=never
one ac240 240 4 shardc-ac
one closs240 240 4 fsdp2-compile-ac-closs
one ck600 600 3 shardc-budget SHARDC_PEAK_BUDGET=auto
one closs360 360 3 fsdp2-compile-ac-closs
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_env.sh
SP=$(python3 -c "import site;print(site.getsitepackages()[0])")
mkdir -p $SP/shardc-0.0.dev0.dist-info
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $SP/shardc-0.0.dev0.dist-info/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $SP/shardc-0.0.dev0.dist-info/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# third call (main b82bcd8; the device's .git is stale: its commit line shows 49cc231 with b82bcd8's changes as modified files)
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # name batch steps mode [env]
  local n=$1 b=$2 s=$3 m=$4; shift 4
  echo "== $n $(date +%T)"
  env "$@" timeout 200 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one ck600 600 5 shardc-budget SHARDC_PEAK_BUDGET=auto
one closs360 360 5 fsdp2-compile-ac-closs
echo "== curve $(date +%T)"
timeout 250 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b --steps 5 --budgets 9661387487 10841563645 \
  --baselines fsdp2-compile-offload --deadline-s 230 --run-timeout-s 150 --out $R/curve -- --n-layers 8 > $R/curve.log 2>&1
echo "rc=$? $(date +%T)"; tail -25 $R/curve/curve.md 2>/dev/null
cd $OUT && tar czf c3.tgz r && rm -rf r

# fourth call (main b82bcd8, same)
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # name batch steps timeout mode [env]
  local n=$1 b=$2 s=$3 t=$4 m=$5; shift 5
  echo "== $n $(date +%T)"
  env "$@" timeout $t torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one closs360 360 5 120 fsdp2-compile-ac-closs
one ck540 540 5 200 shardc-budget SHARDC_PEAK_BUDGET=122000000000
one ck600 600 4 170 shardc-budget SHARDC_PEAK_BUDGET=auto
cd $OUT && tar czf c4.tgz r && rm -rf r
