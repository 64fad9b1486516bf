# s58 call B (issue 19): one H100: the rest of the s55 H200 table's configurations, predicted with this session's H100 calibration
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
timeout 400 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile .probe/s58/h100_s58.json --configs 1b:16:1,1b:32:1,wide:8:1,1b:8:4:fp8,1b:8:1:fp8,wide:16:2 --blocks-once --steps 10 --deadline-s 370 --out $R --name predict_s58b > $R/predict_s58b.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s58b.md | head -9 | cut -c1-200
cd $OUT && tar czf callB.tgz r && rm -rf r
