# s56 call 1 (issue 20): the sunk residual (sink_block_residual) at default shardc's peak, world 1, 1b (.probe/call3.sh when run).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
mkdir -p $OUT/r
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $OUT/r/machine.txt
timeout 330 python3 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 1 4 \
  --modes bound shardc shardc-sink shardc-packed shardc-packed-sink --steps 15 --warmup 3 --rounds 3 --profile-steps 1 \
  --out $OUT/r --name so_sink_w1 > $OUT/r/so_sink_w1.log 2>&1; echo "so rc=$? $(date +%T)"
grep -E "^\|" $OUT/r/so_sink_w1.md | head -14 | cut -c1-160
timeout 200 python3 benchmarks/train_bench.py --model 1b --n-layers 32 --modes shardc shardc-sink --steps 8 --warmup 3 \
  --profile-steps 0 --no-dump-plan --out $OUT/r --name tb_sink32 > $OUT/r/tb_sink32.log 2>&1; echo "tb rc=$? $(date +%T)"
grep -E "^\|" $OUT/r/tb_sink32.md | head -8 | cut -c1-240
cd $OUT && tar czf call3.tgz r && rm -rf r
