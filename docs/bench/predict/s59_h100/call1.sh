# s59 call 1 (issue 19): one H100, torch 2.11: calibrate with the corrected FP8 host fit (through zero where the
# two-depth line starts below it), then predicted vs measured with that profile: the FP8 rows and two bf16 rows
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])'); D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD
R=$OUT/r; rm -rf $R; mkdir -p $R
(nvidia-smi -L; nproc; python3 -c "import torch; print(torch.__version__)"; git log -1 --format=%H; git status --short) > $R/machine.txt
timeout 170 python3 -m shardc calibrate --out $R/h100_s59.json > $R/calibrate.log 2>&1; echo "cal rc=$? $(date +%T)"; tail -3 $R/calibrate.log
P=$R/h100_s59.json; [ -f $P ] || P=shardc/planning/profiles/h100.json
timeout 330 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1:fp8,1b:8:4:fp8,1b:16:1,1b:8:2 --blocks-once --steps 10 --deadline-s 310 --out $R --name predict_s59a > $R/predict_s59a.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s59a.md | head -9 | cut -c1-260
cp $R/h100_s59.json $OUT/ 2>/dev/null
cd $OUT && tar czf call1.tgz r && rm -rf r
