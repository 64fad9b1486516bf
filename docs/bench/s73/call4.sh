# s73 call 4, as one inline command on the warm device: tests/gpu on the cast variant (s73v/cast: the
# split unpack and the body output casts).
source docs/bench/s61_not_run/prelude.sh; (PYTHONPATH=$PWD/s73v/cast:$PWD:$PWD/tests timeout 420 python3 -m pytest -q -p no:cacheprovider -x tests/gpu > $R/gpu_tests.log 2>&1); echo "gpu rc=$? $(date +%T)"; tail -15 $R/gpu_tests.log; cd $OUT && tar czf call4.tgz r && rm -rf r
