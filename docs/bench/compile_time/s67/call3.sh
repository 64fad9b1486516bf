# call 3: the forward-cast GPU tests at the final code (the input cast's dataclass entry, 7cb4cd4)
source docs/bench/s61_not_run/prelude.sh
(timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_forward_casts_gpu.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"); grep -E "PASSED|FAILED|passed|failed|rel err" $R/gpu_tests.log | tail -8
cat $R/machine.txt | tail -1
cd $OUT && tar czf call3.tgz r && rm -rf r
