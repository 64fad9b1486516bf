# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_c2.sh
# s17 call 2 (issue 19): calibrate on 2 GPUs (profile v8: device AdamW ratios, 2048-token and weight-gradient matmuls), then predict_step with CUDA graphs and the auto budget
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 200 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s17.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/calibrate.log
P=$R/2xh200_s17.json; [ -f $P ] || P=h200
echo "== predict ($P) $(date +%T)"
timeout 330 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:1,1b:16:4,wide:8:2 --blocks-once --cudagraphs --memory-budget auto \
  --steps 12 --deadline-s 300 --out $R --name predict_cg > $R/predict_cg.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (1b|wide)" $R/predict_cg.md | cut -c1-260
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_c3.sh (its last step: predict_cg2)
# s17 call 3: world-1 step overhead again, the modes in the reverse order (issue 20); then predict_step with CUDA graphs and the graphed peak (issue 19)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv -l 2 > $R/clocks.csv 2>&1 &
SMI=$!
so() { # gpu port name layers...
  local g=$1 p=$2 n=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g timeout 400 torchrun --nproc-per-node 1 --master-port $p benchmarks/step_overhead.py --model 1b --n-layers "$@" \
    --modes bound-cudagraphs shardc-fast-budget-inline shardc-fast-budget bound --steps 10 --warmup 3 --out $R --name $n > $R/$n.log 2>&1
  echo "$n rc=$? $(date +%T)"
}
echo "start $(date +%T)"
so 0 29511 w1r_8_16 8 16 & A=$!
so 1 29512 w1r_32 32 & B=$!
wait $A $B
kill $SMI
grep -E "^\| 1b \| (8|16|32) \| 4 \| [a-z-]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9./]+ \|" $R/*.md | cut -c1-160
echo "== predict $(date +%T)"
timeout 200 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile docs/bench/predict/2xh200_s17_calibrated.json --configs 1b:16:1,1b:16:4,wide:8:2 --blocks-once --cudagraphs --memory-budget auto \
  --steps 12 --deadline-s 180 --out $R --name predict_cg2 > $R/predict_cg2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_cg2.md | head -3 | cut -c1-260
cd $OUT && tar czf c3.tgz r && rm -rf r
