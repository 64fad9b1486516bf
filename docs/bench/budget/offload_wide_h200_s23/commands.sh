# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_2.sh (call 2, machine start A; main 9f8050e exactly: commit.txt)
# s23 call 2 (issue 22): the failing optimizer-offload budget test alone; then the wide config's CPU-offload points at world 1 on cast22's code (auto, 6.69e9, 6.2e9 B beside FSDP2 + CPUOffloadPolicy), 15 timed steps each, fused AdamW
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== budget test alone $(date +%T)"
CUDA_VISIBLE_DEVICES=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu "tests/gpu/test_offload_gpu.py::test_peak_budget_below_the_optimizer_step_trains_with_the_state_on_the_host" > $R/test_budget_alone.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "AssertionError:|passed|failed" $R/test_budget_alone.log | head -3
echo "== offload $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 440 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto 6.69e9 6.2e9 --baselines fsdp2-compile-offload --run-timeout-s 140 --out $R/offload_wide_s23 -- --n-layers 8 --optim-impl fused --steps 15 > $R/offload_wide_s23.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (shardc|fsdp2)" $R/offload_wide_s23/curve.md | cut -c1-220
tail -3 $R/offload_wide_s23.log | cut -c1-250
cd $OUT && tar czf c2.tgz r && rm -rf r
