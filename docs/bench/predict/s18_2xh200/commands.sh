# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_c1.sh
# s18 call 1 (issue 19): calibrate on 2 GPUs with the AdamW timing fix (profile v8), then predict_step with CUDA graphs and the auto budget, keeping the kernels and plans; then default shardc (no graphs, no budget) at 1b 16L batch 4
source gpu_env.sh
R=$OUT/r; mkdir -p $R/traces
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 150 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s18.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/calibrate.log
P=$R/2xh200_s18.json; [ -f $P ] || P=docs/bench/predict/2xh200_s17_calibrated.json
echo "== predict ($P) $(date +%T)"
timeout 240 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:1,1b:16:4,wide:8:2 --blocks-once --cudagraphs --memory-budget auto \
  --steps 12 --deadline-s 210 --keep-traces $R/traces --out $R --name predict_cg > $R/predict_cg.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_cg.md | head -3 | cut -c1-260
echo "== predict default $(date +%T)"
timeout 130 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:4 --blocks-once \
  --steps 12 --deadline-s 110 --keep-traces $R/traces --out $R --name predict_default > $R/predict_default.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_default.md | head -3 | cut -c1-260
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_c2.sh (its compile-time half: docs/bench/compile_time/ct_gpu_s18/)
# s18 call 2: predict_step again with the exposed-communication changes (issue 19: the wait before the embedding gradient's cast, indexed accumulations priced by their rows, 'waited for' measured), then cold compile time of default shardc, plain-pool and fsdp2-compile at 8 and 32 layers on one GPU (issue 18)
source gpu_env.sh
R=$OUT/r; mkdir -p $R/traces
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/2xh200_s18_calibrated.json
echo "== predict ($P) $(date +%T)"
timeout 240 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:1,1b:16:4,wide:8:2 --blocks-once --cudagraphs --memory-budget auto \
  --steps 12 --deadline-s 210 --keep-traces $R/traces --out $R --name predict_cg2 > $R/predict_cg2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_cg2.md | head -3 | cut -c1-260
echo "== compile time $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths 8 32 --modes fsdp2-compile shardc-plain-pool shardc --caches cold \
  --steps 3 --timeout-s 150 --out $R --name ct_s18 > $R/ct_s18.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/ct_s18.md | head -12 | cut -c1-220
cd $OUT && tar czf c2.tgz r && rm -rf r
