# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# the call (gpu_c1.sh) on 2 x H200
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== gpu test $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_cudagraphs_gpu.py -x > $R/cg_test.log 2>&1; echo "rc=$?"; tail -3 $R/cg_test.log
tb() { # name batch modes...
  local n=$1 b=$2; shift 2
  echo "== $n $(date +%T)"
  timeout 250 torchrun --nproc-per-node 2 benchmarks/train_bench.py --model 1b --batch $b --modes "$@" \
    --steps 15 --warmup 4 --profile-steps 2 --no-dump-plan --deadline-s 225 --mode-estimate-s 50 --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU|Error|rror:" $R/$n.log | tail -8 | cut -c1-300
}
tb fast_b1 1 bound shardc shardc-cudagraphs shardc-fast
tb fast_b2 2 bound shardc shardc-cudagraphs shardc-fast
cd $OUT && tar czf c1.tgz r && rm -rf r
