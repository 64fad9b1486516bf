# s66 call 2 (one GPU): the offload and host-rate GPU tests (call 1 ran the others).
source docs/bench/s61_not_run/prelude.sh
timeout 470 python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 150 --durations=25 \
    tests/gpu/test_offload_gpu.py tests/gpu/test_host_rates_gpu.py > $R/gpu_tests2.log 2>&1
echo "gpu tests rc=$?"
grep -E "PASSED|FAILED|ERROR|Timeout" $R/gpu_tests2.log | head -40; tail -3 $R/gpu_tests2.log
