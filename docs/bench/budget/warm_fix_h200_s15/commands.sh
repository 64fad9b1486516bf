# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# the call (main d3aae4a: the warm-restart fix merged)
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) SHARDC_PEAK_BUDGET=0 SHARDC_ACTIVATION_OFFLOAD='checkpoint:*'
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt
for r in cold warm; do
  echo "== $r $(date +%T)"
  timeout 140 torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch 120 --modes shardc-budget --steps 3 --warmup 1 --profile-steps 0 --no-dump-plan --out $R --name $r > $R/$r.log 2>&1
  echo "rc=$?"; grep -E "tokens/s/GPU, step|Error|cache hit" $R/$r.log | tail -2 | cut -c1-250
  python3 -c "import json;r=list(json.load(open('$R/$r.json'))['models']['1b']['results'].values())[0];print(r['peak_alloc_bytes'], r['warmup_step_s'])"
done
cd $OUT && tar czf c5.tgz r && rm -rf r
