# s75 call 2 (same machine start): dropout bodies on CUDA (dropout_cuda.py), then tests/gpu on
# main (not rerun whole since s71), as much as the call's time allows.
source docs/bench/s61_not_run/prelude.sh
(PYTHONPATH=$PWD:$PWD/tests timeout 150 python3 docs/bench/s75/dropout_cuda.py > $R/dropout_cuda.log 2>&1); echo "dropout rc=$? $(date +%T)"
grep -v Warning $R/dropout_cuda.log | tail -8
(PYTHONPATH=$PWD:$PWD/tests timeout 400 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs > $R/gpu_tests.log 2>&1); echo "gpu rc=$? $(date +%T)"
tail -40 $R/gpu_tests.log
cd $OUT && tar czf call2.tgz r && rm -rf r
