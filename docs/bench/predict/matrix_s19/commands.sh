# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1


# gpu_c1.sh
# s19 call 1 (issue 19): the predicted-vs-measured matrix, HSDP / TP parts then FSDP over 2 GPUs, blocks once, CUDA graphs, auto budget, the s18 2xH200 profile
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/2xh200_s18_calibrated.json
echo "== fsdp2 + mesh parts $(date +%T)"
timeout 560 python3 benchmarks/predict_matrix.py --parts fsdp2,hsdp2x1,tp2,hsdp1x2 --profile $P --out $R --deadline-s 530 -- --blocks-once --cudagraphs --memory-budget auto --steps 10 > $R/matrix.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| 2 " $R/predict_matrix.md | cut -c1-200
tail -5 $R/matrix.log
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_c2.sh
# s19 call 2 (issue 19): the matrix, FSDP over 2 GPUs (wide, 1b 32L), then world 1 on both GPUs at once
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/2xh200_s18_calibrated.json
echo "== fsdp2-wide + 1gpu $(date +%T)"
timeout 560 python3 benchmarks/predict_matrix.py --parts fsdp2-wide,1gpu --profile $P --out $R --deadline-s 545 -- --blocks-once --cudagraphs --memory-budget auto --steps 10 > $R/matrix.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| [12] " $R/predict_matrix.md | cut -c1-200
tail -5 $R/matrix.log
cd $OUT && tar czf c2.tgz r && rm -rf r

