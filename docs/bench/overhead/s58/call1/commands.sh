# s58 call 1 (issue 20): one H100, world 1, 1b, batch 4: cast throughput; 8 layers, fast-sink with per-parameter casts
# (.probe/castbench.py was the untracked probe folder's copy of castbench.py, kept beside this file)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv -lms 1000 > $R/clocks.csv 2>&1 &
SMI=$!
timeout 90 python3 .probe/castbench.py $R/castbench.json > $R/castbench.log 2>&1; echo "cast rc=$? $(date +%T)"; cat $R/castbench.log | grep -v Warn | tail -20
so() {  # name layers timeout modes...
  n=$1; L=$2; t=$3; shift 3
  timeout $t python3 benchmarks/step_overhead.py --model 1b --n-layers $L --batch 4 --modes "$@" \
    --steps 15 --warmup 3 --rounds 3 --profile-steps 1 --out $R --name $n > $R/$n.log 2>&1; echo "$n rc=$? $(date +%T)"
  grep -A6 "step ms per round" $R/$n.md | cut -c1-160; }
so so8 8 200 bound shardc-fast-sink shardc-fast-sink-pcasts
kill $SMI
cd $OUT && tar czf call1.tgz r && rm -rf r
