# s65 call A2 (one GPU): call A's GPU tests stopped at its 400 s limit after 23 passed, in the
# offload tests; run those alone, verbose, each test limited to 150 s, with the stand-in tests'
# spawned ranks on the device's torch 2.11 CPU beside them (CUDA hidden: forked ranks cannot
# initialize CUDA, which call A's run of them hit).
source docs/bench/s61_not_run/prelude.sh
(CUDA_VISIBLE_DEVICES= timeout 400 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
    tests/test_body_standin.py > $R/cpu_standin_tests_torch211.log 2>&1; \
    echo "rc=$?" >> $R/cpu_standin_tests_torch211.log) &
timeout 470 python3 -m pytest -m gpu -v -p no:cacheprovider --timeout 150 --durations=25 \
    tests/gpu/test_offload_gpu.py tests/gpu/test_host_rates_gpu.py > $R/gpu_tests.log 2>&1
echo "gpu tests rc=$?"
wait
grep -E "PASSED|FAILED|ERROR|Timeout" $R/gpu_tests.log | head -40; tail -30 $R/gpu_tests.log | grep -E "s call|passed|failed"; tail -3 $R/cpu_standin_tests_torch211.log
