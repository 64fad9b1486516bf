# s36: one nvidia-h200 start (torch 2.11). gpu_env.sh = docs/bench/predict/s21_default/commands.sh lines 2-6;
# gpu_var/det2.py is variants/det2.py. The device's .git is stale: commit.txt has checksums (main a8e18f3).
# s36: the GPU offload tests at main a8e18f3 (incl. the not-yet-run local_shard_step test), the
# offloaded Inductor run's reproducibility with and without deterministic algorithms, and
# worker_gil.py on the H200 host. The device's .git is stale; commit.txt has checksums.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
md5sum shardc/optim/step_in_backward.py shardc/optim/local_step.py tests/gpu/test_offload_gpu.py gpu_var/det2.py >> $R/commit.txt
echo "== tests $(date +%T)"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_offload_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -15 | cut -c1-300
echo "== det2 deterministic $(date +%T)"
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 150 python3 gpu_var/det2.py --det --pairs 2 > $R/det_on.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "differ|reference|deterministic" $R/det_on.log
echo "== det2 default $(date +%T)"
timeout 120 python3 gpu_var/det2.py --pairs 2 > $R/det_off.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "differ|reference|deterministic" $R/det_off.log
for c in dtensor plain; do
  echo "== worker_gil $c $(date +%T)"
  timeout 60 python3 benchmarks/worker_gil.py --case $c > $R/gil_$c.log 2>&1; echo "rc=$?"; tail -6 $R/gil_$c.log
done
cd $OUT && tar czf s36.tgz r && rm -rf r
