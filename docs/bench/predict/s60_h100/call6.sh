# s60 call 6 (issue 19): two more rows with call 5's calibration
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; git log -1 --format=%H; git status --short) > $R/machine.txt
P=.probe/h100_s60e.json
[ -f $P ] && timeout 280 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:4:fp8,1b:32:1 --blocks-once --steps 10 --deadline-s 250 --out $R --name predict_s60f > $R/predict_s60f.log 2>&1; echo "prede rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_s60f.md | head -2 | cut -c1-200
cd $OUT && tar czf call6.tgz r && rm -rf r
