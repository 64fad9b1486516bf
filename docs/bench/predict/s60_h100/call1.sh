# s60 call 1 (issue 19): one H100, torch 2.11. (a) the compiled chains' host cost, as timed before s60 and as
# now, three fresh processes; (b) `python -m shardc calibrate` twice (separate processes) with the s60 code.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(date -u; nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
for i in 1 2 3; do
  timeout 90 python3 .probe/chain_diag.py p$i >> $R/chain_diag.jsonl 2> $R/chain_diag_$i.err; echo "diag$i rc=$? $(date +%T)"
done
python3 -c "
import json
for l in open('$R/chain_diag.jsonl'):
    d=json.loads(l); print(d['tag'], 'old_first %.1f us' % d['old_first']['per_kernel_us'], 'new %.1f us %s' % (d['new_rounds']['per_kernel_us'], d['new_rounds']['spread_us']['compiled_launch_s']), 'old_again %.1f us' % d['old_style_again']['per_kernel_us'])
"
for t in a b; do
  timeout 200 python3 -m shardc calibrate --out $R/h100_s60$t.json > $R/calibrate_$t.log 2>&1; echo "cal$t rc=$? $(date +%T)"
  grep -E "compiled graphs|host \(fit|FP8 host|probe" $R/calibrate_$t.log | cut -c1-400
done
cp $R/h100_s60*.json $OUT/ 2>/dev/null
cd $OUT && tar czf call1.tgz r && rm -rf r
