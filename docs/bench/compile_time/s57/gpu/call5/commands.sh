# s57 call 5 (issue 20): world 1, 1b, batch 4, 8 and 32 layers: bound, shardc, shardc-fast-sink (one process per depth, rounds)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $R/machine.txt
for L in 8 32; do
  timeout 260 python3 benchmarks/step_overhead.py --model 1b --n-layers $L --batch 4 --modes bound shardc shardc-fast-sink \
    --steps 15 --warmup 3 --rounds 3 --profile-steps 1 --out $R --name so_fast$L > $R/so_fast$L.log 2>&1; echo "L$L rc=$? $(date +%T)"
  grep -A6 "step ms per round" $R/so_fast$L.md | cut -c1-160
done
cd $OUT && tar czf call5.tgz r && rm -rf r
