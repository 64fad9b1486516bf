# s56 call 3 (issue 18): reserved memory per mode at 16 and 8 layers, world 1 (.probe/call1.sh when run).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
mkdir -p $OUT/r
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $OUT/r/machine.txt
for L in 16 8; do for m in shardc shardc-packed; do
  timeout 95 python3 docs/bench/compile_time/s54/memseg.py $m $L $OUT/r/memseg_${m}_L$L.json > $OUT/r/memseg_${m}_L$L.log 2>&1
  echo "$m L$L rc=$? $(date +%T)"; grep -E "reserved|allocated|replay" $OUT/r/memseg_${m}_L$L.log | tail -3
done; done
cd $OUT && tar czf call1.tgz r && rm -rf r
