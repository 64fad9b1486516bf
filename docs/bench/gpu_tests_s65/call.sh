# s65 call A (one GPU): main's one-GPU tests, the s64/s65 stand-in fixes on CUDA, and the
# stand-in tests on the device's torch 2.11 (CPU, beside the GPU tests).
# run from the repository root: bash docs/bench/gpu_tests_s65/call.sh
source docs/bench/s61_not_run/prelude.sh
(timeout 420 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    tests/test_body_standin.py > $R/cpu_standin_tests_torch211.log 2>&1; \
    echo "rc=$?" >> $R/cpu_standin_tests_torch211.log) &
timeout 120 python3 docs/bench/standin_s65/cuda_standins.py > $R/cuda_standins.log 2>&1; echo "probe rc=$?"
timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 tests/gpu \
    > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"
wait
tail -3 $R/gpu_tests.log; tail -3 $R/cpu_standin_tests_torch211.log; cat $R/cuda_standins.log | grep -v Warning
