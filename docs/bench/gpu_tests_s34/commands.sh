# GPU tests at main cb23eb4 (the device's .git said 94bdd8c; commit.txt lists the files that differed). gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6).
# s34 call 3: the GPU tests of the peak budget / offload (test_offload_gpu.py, after the refusal-minimum change)
# and of the host rates (test_host_rates_gpu.py, beside the new host AdamW probe), at main.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== tests $(date +%T)"
timeout 500 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_gpu.py tests/gpu/test_host_rates_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -15 | cut -c1-300
cd $OUT && tar czf t34.tgz r && rm -rf r
