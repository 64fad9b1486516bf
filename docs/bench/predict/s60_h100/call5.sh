# s60 call 5 (issue 19): a third calibration with the s60 code, and the plan compiled with it against measured.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; git log -1 --format=%H; git status --short) > $R/machine.txt
timeout 200 python3 -m shardc calibrate --out $R/h100_s60e.json > $R/calibrate_e.log 2>&1; echo "cale rc=$? $(date +%T)"
grep -E "compiled graphs|host \(fit|FP8 host|probe" $R/calibrate_e.log | cut -c1-300
P=$R/h100_s60e.json
[ -f $P ] && timeout 240 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1:fp8,1b:8:2 --blocks-once --steps 10 --deadline-s 220 --out $R --name predict_s60e > $R/predict_s60e.log 2>&1; echo "prede rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_s60e.md | head -2 | cut -c1-200
cd $OUT && tar czf call5.tgz r && rm -rf r
