# s72 call 1: (a) the two GPU tests s71 fixed without a GPU; (b) packed blocks' extra reserved
# memory (s71: +4.4% at 16 layers): allocator counters and segments per mode, with and without
# expandable segments, one process each; (c) issue 20, world 1: where packed shardc's GPU time
# over the bound goes (top 48 kernels per mode), and the planner-kept buckets (shardc-budget).
source docs/bench/s61_not_run/prelude.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_checkpoint_manager_gpu.py tests/gpu/test_cudagraphs_gpu.py \
  -k "manager_saves_and_loads_on_a_cuda_mesh or one_rank_casts_record" > $R/gpu_tests_s71fixed.log 2>&1; echo "tests rc=$? $(date +%T)"; tail -3 $R/gpu_tests_s71fixed.log
for m in shardc shardc-unpacked; do for ac in "" "expandable_segments:True"; do
  n=res_${m}_${ac:+exp}; PYTORCH_CUDA_ALLOC_CONF=$ac timeout 90 torchrun --nproc-per-node 1 docs/bench/s72/reserved_probe.py $m 16 > $R/$n.log 2>&1
  echo "$n rc=$? $(date +%T)"; grep PROBE $R/$n.log | cut -c1-700; done; done
timeout 170 torchrun --nproc-per-node 1 benchmarks/step_overhead.py --model 1b --n-layers 16 --batch 4 --modes bound shardc shardc-budget \
  --steps 15 --warmup 3 --rounds 1 --profile-steps 2 --top 24 --out $R --name so16b4 > $R/so16b4.log 2>&1; echo "so rc=$? $(date +%T)"
grep -E "^\| 1b" $R/so16b4.md | head -8
cd $OUT && tar czf call1.tgz r && rm -rf r
