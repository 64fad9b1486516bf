# s57 call 2 (issue 18): allocated/reserved peaks at 8 layers, per-parameter vs packed (with the donation padding), world 1
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $R/machine.txt
for m in shardc-packed shardc; do
  timeout 100 python3 docs/bench/compile_time/s54/memseg.py $m 8 $R/memseg_${m}_L8.json > $R/memseg_${m}_L8.log 2>&1
  echo "$m L8 rc=$? $(date +%T)"; grep -E "reserved|allocated|replay|donat" $R/memseg_${m}_L8.log | tail -4
done
cd $OUT && tar czf call2.tgz r && rm -rf r
