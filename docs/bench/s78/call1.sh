# s78 call 1: the whole GPU test directory on main (last complete run: s50; s77's was never started).
source docs/bench/s61_not_run/prelude.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
(PYTHONPATH=$PWD:$PWD/tests timeout 540 python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu -rs --durations=12 > $R/gpu_all.log 2>&1); echo "gpu all rc=$? $(date +%T)"
grep -E "PASSED|FAILED|ERROR" $R/gpu_all.log | cut -c1-160; tail -40 $R/gpu_all.log | cut -c1-200
