# s66 call 1 (one GPU): the forward casts on CUDA (Inductor, with and without CUDA graphs), then
# main's one-GPU tests but the offload and host-rate files (call 2).
# run from the repository root: bash docs/bench/forward_casts_s66/call1.sh
source docs/bench/s61_not_run/prelude.sh
timeout 150 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/gpu/test_forward_casts_gpu.py \
    > $R/forward_casts_gpu.log 2>&1; echo "forward casts rc=$?"
timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/gpu \
    --ignore=tests/gpu/test_forward_casts_gpu.py --ignore=tests/gpu/test_offload_gpu.py \
    --ignore=tests/gpu/test_host_rates_gpu.py > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"
grep -E "rel err|PASSED|FAILED|passed|failed" $R/forward_casts_gpu.log; tail -3 $R/gpu_tests.log
