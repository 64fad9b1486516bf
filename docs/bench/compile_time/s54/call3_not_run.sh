# NOT RUN in s54 (no machine could be started after call 2) nor in s55 (no machine lent); kept for the next GPU session.
# (s55) memseg.py also writes memseg_<mode>.history.json.gz: the allocator histories for offline replays
# (shardc.memory.allocator_history), in call3.tgz.
# s54 call 3 (issues 18, 19): (a) the caching allocator's segments per mode at 32 layers (shardc per-parameter
# reads vs shardc-packed), each its own process; (b) calibrate this H200 with the plain reads (shard's default);
# (c) steps predicted with that profile against measured, 1b 8 layers batch 1 and 4, back to back in one process
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
(nvidia-smi -L; nproc; git log -1 --format=%H; git status --short) > $OUT/machine.txt
for m in shardc shardc-packed; do timeout 140 python3 docs/bench/compile_time/s54/memseg.py $m 32 $OUT/memseg_$m.json > $OUT/memseg_$m.log 2>&1; echo "$m rc=$? $(date +%T)"; tail -2 $OUT/memseg_$m.log; done
timeout 160 python3 -m shardc calibrate --out $OUT/h200_s54.json > $OUT/calibrate.log 2>&1; echo "cal rc=$? $(date +%T)"; tail -3 $OUT/calibrate.log
P=$OUT/h200_s54.json; [ -f $P ] || P=shardc/planning/profiles/h200.json
timeout 110 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1,1b:8:4 --blocks-once --steps 10 --deadline-s 100 --out $OUT --name predict_s54 > $OUT/predict_s54.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $OUT/predict_s54.md | head -8 | cut -c1-260
# (s55) at most 8 files come back: everything in one archive, the two summaries beside it
cd $OUT && tar czf call3.tgz --exclude=call3.tgz . && find . -type f ! -name call3.tgz ! -name machine.txt ! -name 'memseg_*.json' -delete
