# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# call 1 (gpu_c3.sh): cold caches on a fresh machine start; main b6c85c6 + the record_stream change (committed as f999711); gpu_ab/ held main's two files
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== gpu test $(date +%T)"
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_activation_offload_gpu.py -x > $R/ao_test.log 2>&1; echo "rc=$?"; tail -2 $R/ao_test.log
one() { # name batch steps timeout mode [env]
  local n=$1 b=$2 s=$3 t=$4 m=$5; shift 5
  echo "== $n $(date +%T)"
  env "$@" timeout $t torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
}
one ck600_norecord 600 4 165 shardc-budget SHARDC_PEAK_BUDGET=auto
cp shardc/ops/offload_copy.py gpu_ab/new_offload_copy.py; cp shardc/passes/offload_saved.py gpu_ab/new_offload_saved.py
cp gpu_ab/offload_copy.py shardc/ops/offload_copy.py; cp gpu_ab/offload_saved.py shardc/passes/offload_saved.py
one ck600_record 600 4 165 shardc-budget SHARDC_PEAK_BUDGET=auto
cp gpu_ab/new_offload_copy.py shardc/ops/offload_copy.py; cp gpu_ab/new_offload_saved.py shardc/passes/offload_saved.py
one closs360 360 4 110 fsdp2-compile-ac-closs
cd $OUT && tar czf c3.tgz r && rm -rf r

# call 2 (gpu_c4.sh): the next call on the same machine, the Inductor cache directory of call 1 still there
source gpu_env.sh
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
one() { # name batch steps timeout mode [env]
  local n=$1 b=$2 s=$3 t=$4 m=$5; shift 5
  echo "== $n $(date +%T)"
  env "$@" timeout $t torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 8 --batch $b \
    --modes $m --steps $s --warmup 2 --profile-steps 0 --no-dump-plan --out $R --name $n > $R/$n.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "tokens/s/GPU, step|Error" $R/$n.log | tail -2 | cut -c1-300
  python3 -c "import json;r=list(json.load(open('$R/$n.json'))['models']['1b']['results'].values())[0];print(r.get('step_ms_rank0'),r['peak_reserved_bytes'],r['allocator_per_timed_steps_per_rank'])"
}
cp shardc/ops/offload_copy.py gpu_ab/new_offload_copy.py; cp shardc/passes/offload_saved.py gpu_ab/new_offload_saved.py
cp gpu_ab/offload_copy.py shardc/ops/offload_copy.py; cp gpu_ab/offload_saved.py shardc/passes/offload_saved.py
one ck600_record 600 6 190 shardc-budget SHARDC_PEAK_BUDGET=auto
cp gpu_ab/new_offload_copy.py shardc/ops/offload_copy.py; cp gpu_ab/new_offload_saved.py shardc/passes/offload_saved.py
one ck600_norecord 600 6 190 shardc-budget SHARDC_PEAK_BUDGET=auto
one closs360 360 6 100 fsdp2-compile-ac-closs
cd $OUT && tar czf c4.tgz r && rm -rf r
