# gpu_env.sh (sourced by every call)
SP=$(python3 -c 'import site; print(site.getsitepackages()[0])')
D=$SP/shardc-0.0.dev0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: shardc\nVersion: 0.0.dev0\n' > $D/METADATA
printf '[torch_dynamo_backends]\nshardc = shardc.backend:shardc_backend\n' > $D/entry_points.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_a.sh

# gpu_1.sh (call 1, machine start A)
# s21 call 1 (issue 19): calibrate over both ranks on this machine start (the host's seconds per collective fitted now, not the 15 us default), then default shardc (no CUDA graphs, no budget) at world 2 predicted with that profile: 1b 8L batch 1, 2 and 4; then the host's time per phase and operator of the batch-1 step (step_overhead, CPU activities)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 230 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s21.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/calibrate.log
P=$R/2xh200_s21.json; [ -f $P ] || P=h200
echo "== predict ($P) $(date +%T)"
timeout 190 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:8:1,1b:8:2,1b:8:4 --blocks-once --steps 10 --deadline-s 175 --out $R --name predict_default > $R/predict_default.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| 1b" $R/predict_default.md | cut -c1-220
echo "== step_overhead b1 $(date +%T)"
timeout 120 torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 1 --modes shardc --steps 10 --warmup 3 --profile-steps 3 --out $R --name so_w2_b1 > $R/so_w2_b1.log 2>&1; echo "rc=$? $(date +%T)"
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_2.sh (call 2, machine start B; its first part, the FP8 row; the rest is in docs/bench/overhead/s21_2xh200/commands.sh)
# s21 call 2: (issue 19) default shardc at world 2, FP8 batch 4 and 16 layers batch 4, predicted with call 1's profile (calibrated on the same machine start); then (issue 20) world 1 on each GPU at once: GPU 0 interleaved rounds of the bound, the bound under CUDA graphs, shardc-fast-sink and default shardc (1b 16L batch 4) with the SM clock, power and throttle reasons sampled every 200 ms; GPU 1 the reserved memory of default shardc and shardc-fast-sink with a fused AdamW, then with torch's default (foreach)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/s21_default/2xh200_s21.json
echo "== predict fp8, 16L ($P) $(date +%T)"
timeout 175 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:8:4:fp8,1b:16:4 --blocks-once --steps 10 --deadline-s 160 --out $R --name predict_default2 > $R/predict_default2.log 2>&1; echo "rc=$? $(date +%T)"
echo "== world 1 $(date +%T)"
nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 200 > $R/smi_gpu0.csv 2>&1 &
SMI=$!
CUDA_VISIBLE_DEVICES=0 timeout 345 torchrun --master-port 29600 --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 4 --modes bound bound-cudagraphs shardc-fast-sink shardc --rounds 3 --steps 10 --warmup 3 --out $R --name so_16l_clk > $R/so_16l_clk.log 2>&1 &
(for impl in fused default; do
  CUDA_VISIBLE_DEVICES=1 timeout 170 torchrun --master-port 29601 --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers 16 --batch 4 --modes shardc shardc-fast-sink --optim-impl $impl --steps 6 --warmup 3 --profile-steps 0 --no-dump-plan --out $R --name res_16l_$impl > $R/res_16l_$impl.log 2>&1; echo "res $impl rc=$? $(date +%T)"
done) &
wait %2 %3; kill $SMI; echo "done $(date +%T)"
grep -E "^\| 1b" $R/so_16l_clk.md | head -4 | cut -c1-200
for impl in fused default; do grep -E "^\| (shardc)" $R/res_16l_$impl.md | head -2 | cut -c1-250; done
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_4.sh (call 4, machine start C; its first part, the 16-layer row; the rest is in docs/bench/budget/offload_wide_h200_s21/commands.sh)
# s21 call 4: (issue 19) default shardc at world 2, 1b 16 layers batch 4, predicted with call 1's profile; then (issue 22) on each GPU at once, the wide config's offload points again, shardc's offload now stepping each bucket's host AdamW in the backward (step_in_backward): GPU 0 with torch's default AdamW, GPU 1 with fused AdamW in both modes
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/s21_default/2xh200_s21.json
echo "== predict 16L ($P) $(date +%T)"
timeout 150 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:4 --blocks-once --steps 10 --out $R --name predict_default3 > $R/predict_default3.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp 2 \| 1b \| 16 \| 4 x 2048 \| bf16" $R/predict_default3.md | cut -c1-200
echo "== offload $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto --baselines fsdp2-compile-offload --run-timeout-s 160 --out $R/offload_wide_sib -- --n-layers 8 > $R/offload_wide_sib.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 PET_MASTER_PORT=29601 timeout 330 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto --baselines fsdp2-compile-offload --run-timeout-s 160 --out $R/offload_wide_sib_fused -- --n-layers 8 --optim-impl fused > $R/offload_wide_sib_fused.log 2>&1 &
wait; echo "done $(date +%T)"
for n in offload_wide_sib offload_wide_sib_fused; do grep -E "^\| (shardc offload|fsdp2)" $R/$n/curve.md | cut -c1-200; done
cd $OUT && tar czf c4.tgz r && rm -rf r
