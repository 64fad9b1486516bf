# call 2: round 3, then the forward-cast and CUDA-graph GPU tests at this code
source docs/bench/compile_time/s67/common.sh
row before b8c 8 50 shardc-packed
row after a8c 8 50 shardc-packed
row before b64c 64 75 shardc-packed
row after a64c 64 75 shardc-packed
row after a32c 32 60 shardc-packed
rows2 b8c a8c b64c a64c a32c > $R/rows2.txt 2>&1; cut -c1-300 $R/rows2.txt
(timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_forward_casts_gpu.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"); tail -3 $R/gpu_tests.log
cd $OUT && tar czf call2.tgz r && rm -rf r
