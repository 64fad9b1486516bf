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

# gpu_c3.sh (its last step, the predict_step run that wrote predict_cg2.*): recorded whole in
# docs/bench/overhead/s17_2xh200/commands.sh, whose world-1 rows it ran first.
