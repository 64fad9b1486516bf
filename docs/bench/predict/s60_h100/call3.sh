# s60 call 3 (issue 19): one H100, torch 2.11: `python -m shardc calibrate` twice (separate processes) with
# 11 rounds of 8 steps per host fit (s60 main 1b2ae..)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
for t in c d; do
  timeout 280 python3 -m shardc calibrate --out $R/h100_s60$t.json > $R/calibrate_$t.log 2>&1; echo "cal$t rc=$? $(date +%T)"
  grep -E "compiled graphs|host \(fit|FP8 host|probe" $R/calibrate_$t.log | cut -c1-400
done
cp $R/h100_s60*.json $OUT/ 2>/dev/null
cd $OUT && tar czf call3.tgz r && rm -rf r
