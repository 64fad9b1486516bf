# s60 call 2 (issue 19): predicted (the plan compiled on the GPU with call 1's first calibration) against measured,
# the four rows of s59; then the FP8 batch-1 row with the second calibration.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; git log -1 --format=%H; git status --short) > $R/machine.txt
P=.probe/h100_s60a.json; [ -f $P ] || P=shardc/planning/profiles/h100.json; echo "profile $P"
timeout 330 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1:fp8,1b:8:4:fp8,1b:16:1,1b:8:2 --blocks-once --steps 10 --deadline-s 310 --out $R --name predict_s60a > $R/predict_s60a.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s60a.md | head -9 | cut -c1-260
P=.probe/h100_s60b.json
[ -f $P ] && timeout 200 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1:fp8,1b:16:1 --blocks-once --steps 10 --deadline-s 180 --out $R --name predict_s60b > $R/predict_s60b.log 2>&1; echo "predb rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s60b.md | head -5 | cut -c1-260
cd $OUT && tar czf call2.tgz r && rm -rf r
