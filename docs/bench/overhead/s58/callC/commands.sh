# s58 call C (issue 20): one H100, world 1, 1b, 32 layers, batch 4: bound and shardc-fast-sink, each mode in its own process
# (the two do not fit 80 GB together), bound / fast-sink / bound / fast-sink to bracket drift
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
i=0
for m in bound shardc-fast-sink bound shardc-fast-sink; do
  i=$((i+1))
  timeout 140 python3 benchmarks/step_overhead.py --model 1b --n-layers 32 --batch 4 --modes $m --steps 15 --warmup 3 --profile-steps 1 --out $R --name so32_${i}_$m > $R/so32_${i}_$m.log 2>&1
  echo "$i $m rc=$? $(date +%T) $(grep -E '^\| 1b \| 32' $R/so32_${i}_$m.md | head -1 | cut -c1-120)"
done
cd $OUT && tar czf callC.tgz r && rm -rf r
