# gpu_env.sh
# device set-up: the shardc backend's entry point, env for NCCL on this host
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1


# gpu_c3.sh
# s19 call 3: (issue 19) the two rows whose exposed communication missed, again with kept traces; (issue 20) world-1 peak and speed of default shardc, the fast mode and the fast mode with the sunk residual, 1b 16L and 8L batch 4, one GPU each
source gpu_env.sh
R=$OUT/r; mkdir -p $R/traces
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/2xh200_s18_calibrated.json
echo "== predict again $(date +%T)"
timeout 150 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs wide:8:4 --blocks-once --cudagraphs --memory-budget auto --steps 10 --keep-traces $R/traces --out $R --name again_fsdp2 > $R/again_fsdp2.log 2>&1; echo "rc=$? $(date +%T)"
timeout 110 torchrun --nproc-per-node 2 benchmarks/predict_step.py --mesh 1x2 --profile $P --configs 1b:8:4 --blocks-once --cudagraphs --memory-budget auto --steps 10 --keep-traces $R/traces --out $R --name again_hsdp1x2 > $R/again_hsdp1x2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (fsdp|hsdp)" $R/again_*.md | cut -c1-250
echo "== world-1 peaks $(date +%T)"
for L in 16 8; do
  G=$([ $L = 16 ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$G timeout 290 torchrun --master-port 2960$G --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers $L --batch 4 --modes bound shardc shardc-fast-budget shardc-fast-budget-sink --steps 10 --warmup 3 --out $R --name peak_w1_${L}l > $R/peak_w1_${L}l.log 2>&1 &
done
wait; echo "done $(date +%T)"
for L in 16 8; do grep -E "^\| (bound|shardc)" $R/peak_w1_${L}l.md | cut -c1-220; done
cd $OUT && tar czf c3.tgz r && rm -rf r

# gpu_c4.sh
# s19 call 4 (issue 20): world 1, the fast mode with the sunk residual under a peak budget equal to default shardc's measured peak (call 3), beside default shardc and the bound, 1b 16L (GPU 0) and 8L (GPU 1) batch 4
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== world-1 at default's peak $(date +%T)"
for L in 16 8; do
  G=$([ $L = 16 ] && echo 0 || echo 1); B=$([ $L = 16 ] && echo 21356724879 || echo 12058120683)
  SHARDC_PEAK_BUDGET=$B CUDA_VISIBLE_DEVICES=$G timeout 280 torchrun --master-port 2960$G --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers $L --batch 4 --modes bound shardc-fast-budget-sink shardc --steps 10 --warmup 3 --out $R --name eqpeak_w1_${L}l > $R/eqpeak_w1_${L}l.log 2>&1 &
done
wait; echo "done $(date +%T)"
for L in 16 8; do grep -E "^\| (bound|shardc)" $R/eqpeak_w1_${L}l.md | cut -c1-220; done
cd $OUT && tar czf c4.tgz r && rm -rf r

# gpu_c5.sh
# s19 call 5: (issue 20) world 1, the fast modes at default shardc's peak: shardc-fast (no budget: every bucket resharded) and the sunk-residual mode under a budget whose margin leaves exactly the all-resharded plan (nothing kept, nothing recomputed), beside default shardc and the bound, 1b 16L (GPU 0) and 8L (GPU 1) batch 4; then (issue 19) the matrix's FSDP-2 part with default shardc (no CUDA graphs, no budget)
source gpu_env.sh
R=$OUT/r; mkdir -p $R/default
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== world 1 at default's peak $(date +%T)"
for L in 16 8; do
  G=$([ $L = 16 ] && echo 0 || echo 1); B=$([ $L = 16 ] && echo 21730000000 || echo 12240000000)
  SHARDC_PEAK_BUDGET=$B CUDA_VISIBLE_DEVICES=$G timeout 200 torchrun --master-port 2960$G --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers $L --batch 4 --modes bound shardc shardc-fast shardc-fast-budget-sink --steps 10 --warmup 3 --dump-plan --out $R --name reshard_w1_${L}l > $R/reshard_w1_${L}l.log 2>&1 &
done
wait; echo "done $(date +%T)"
for L in 16 8; do grep -E "^\| (bound|shardc)" $R/reshard_w1_${L}l.md | head -4 | cut -c1-200; done
echo "== matrix fsdp2, default shardc $(date +%T)"
timeout 330 python3 benchmarks/predict_matrix.py --parts fsdp2 --out $R/default --deadline-s 315 -- --blocks-once --steps 10 > $R/default/matrix.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| 2 " $R/default/predict_matrix.md | cut -c1-200
cd $OUT && tar czf c5.tgz r && rm -rf r

