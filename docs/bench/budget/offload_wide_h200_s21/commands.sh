# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_3.sh (call 3, machine start B; GPU 0's sweep is c3_foreach_no_overlap/, before shardc-offload stepped in the backward)
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

# gpu_4.sh (call 4, machine start C; c4_concurrent/: the two sweeps ran at once)
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

# gpu_5.sh (call 5, machine start C; c5_seq_fused/, c5_seq_default/)
# s21 call 5 (issue 22): call 4's wide offload points again, one sweep at a time on GPU 0 (call 4 ran its two sweeps at once, so both CPU AdamW steps shared the host): fused AdamW in both modes, then torch's default AdamW
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
for impl in fused default; do
  echo "== offload $impl $(date +%T)"
  CUDA_VISIBLE_DEVICES=0 timeout 215 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto --baselines fsdp2-compile-offload --run-timeout-s 105 --out $R/offload_wide_seq_$impl -- --n-layers 8 --optim-impl $impl > $R/offload_wide_seq_$impl.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "^\| (shardc offload|fsdp2)" $R/offload_wide_seq_$impl/curve.md | cut -c1-200
done
cd $OUT && tar czf c5.tgz r && rm -rf r
