# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_c1.sh (c1: fb_b1/fb_b4; c2: fb_b2/fbw_b1; c3: fbw_b2/fbw_b4 + calibrate + predict_small, the same script edited between calls)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
tb() { # name batch modes...
  local n=$1 b=$2; shift 2
  echo "== $n $(date +%T)"
  timeout 275 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --batch $b --modes "$@" \
    --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan --deadline-s 250 --mode-estimate-s 50 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU|Error|rror:" $R/$n.log | tail -8 | cut -c1-300
  grep -E "^\| (shardc|bound|fsdp|simple)" $R/$n.md | cut -c1-200
}
tbw() { local n=$1 b=$2; shift 2
  echo "== $n $(date +%T)"
  timeout 275 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model wide --batch $b --modes "$@" \
    --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan --deadline-s 250 --mode-estimate-s 50 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU|Error|rror:" $R/$n.log | tail -8 | cut -c1-300
}
tbw fbw_b2 2 bound shardc-fast-budget fsdp2 fsdp2-compile simplefsdp
tbw fbw_b4 4 bound shardc-fast-budget fsdp2 fsdp2-compile simplefsdp
echo "== calibrate $(date +%T)"
timeout 120 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s16.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -2 $R/calibrate.log
echo "== predict $(date +%T)"
timeout 170 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $R/2xh200_s16.json --configs 1b:8:1,1b:8:2 --steps 16 --deadline-s 140 --out $R --name predict_small > $R/predict_small.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| 1b" $R/predict_small.md | cut -c1-200
cd $OUT && tar czf c3.tgz r && rm -rf r

# gpu_c4.sh (c1: fb_b1/fb_b4; c2: fb_b2/fbw_b1; c3: fbw_b2/fbw_b4 + calibrate + predict_small, the same script edited between calls)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
so() { # gpu port name layers...
  local g=$1 p=$2 n=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g timeout 430 torchrun --nproc-per-node 1 --master-port $p benchmarks/step_overhead.py --model 1b --n-layers "$@" \
    --modes bound shardc-fast-budget --steps 10 --warmup 3 --out $R --name $n > $R/$n.log 2>&1
  echo "$n rc=$? $(date +%T)"
}
echo "start $(date +%T)"
so 0 29511 w1_8_16 8 16 &
so 1 29512 w1_32 32 &
wait
grep -E "^\| (8|16|32) " $R/*.md | cut -c1-220
cd $OUT && tar czf c4.tgz r && rm -rf r

# gpu_c5.sh (c1: fb_b1/fb_b4; c2: fb_b2/fbw_b1; c3: fbw_b2/fbw_b4 + calibrate + predict_small, the same script edited between calls)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== bcg_b1 $(date +%T)"
timeout 235 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --batch 1 --modes bound bound-cudagraphs shardc-fast-budget fsdp2 \
    --steps 12 --warmup 3 --profile-steps 2 --no-dump-plan --deadline-s 200 --mode-estimate-s 45 --out $R --name bcg_b1 > $R/bcg_b1.log 2>&1
echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU|Error|rror:" $R/bcg_b1.log | tail -8 | cut -c1-300
cd $OUT && tar czf c5.tgz r && rm -rf r
