# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_2.sh (call 2, machine start B)
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

# gpu_3.sh (call 3, machine start B)
# s21 call 3: (issue 22) GPU 0: shardc's CPU offload under the auto budget beside FSDP2 + CPUOffloadPolicy on the wide config (8 layers, world 1; budget_sweep's offload points); (issue 20) GPU 1 at once: call 2's world-1 rounds (1b 16L batch 4) with a fused AdamW in every mode, clocks sampled
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== start $(date +%T)"
nvidia-smi -i 1 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv -lms 200 > $R/smi_gpu1.csv 2>&1 &
SMI=$!
CUDA_VISIBLE_DEVICES=0 timeout 520 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto --baselines fsdp2-compile-offload --run-timeout-s 250 --out $R/offload_wide -- --n-layers 8 > $R/offload_wide.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 400 torchrun --master-port 29601 --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 4 --modes bound bound-cudagraphs shardc-fast-sink shardc --rounds 3 --steps 10 --warmup 3 --optim-impl fused --out $R --name so_16l_fused > $R/so_16l_fused.log 2>&1 &
wait %2 %3; kill $SMI; echo "done $(date +%T)"
grep -E "^\| 1b" $R/so_16l_fused.md | head -4 | cut -c1-200
tail -25 $R/offload_wide.log | cut -c1-250
cd $OUT && tar czf c3.tgz r && rm -rf r

# then, here: python benchmarks/clocks_by_mode.py so_16l_clk.json smi_gpu0.csv; python benchmarks/clocks_by_mode.py so_16l_fused.json smi_gpu1.csv
