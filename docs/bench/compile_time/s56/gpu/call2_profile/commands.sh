# s56 call 2 (issue 18): where the cold compile's growth 8 -> 64 layers goes on the GPU host (cProfile, packed; .probe/call2.sh when run).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
mkdir -p $OUT/r
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $OUT/r/machine.txt
timeout 330 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 8 64 --pack-blocks --out $OUT/r/prof > $OUT/r/prof.log 2>&1
echo "prof rc=$? $(date +%T)"; tail -22 $OUT/r/prof.log
cd $OUT && tar czf call2.tgz r && rm -rf r
