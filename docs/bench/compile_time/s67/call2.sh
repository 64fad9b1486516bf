# call 2: main after the revert (its shardc/*.py = call 1's "before" tree): one more round of the
# packed rows and FSDP2's, then the forward-cast and CUDA-graph GPU tests at this code
source docs/bench/compile_time/s67/common.sh
row after m8c 8 50 shardc-packed
row after m64c 64 75 shardc-packed
row after m32c 32 60 shardc-packed
row after f32c 32 50 fsdp2-compile
rows2 m8c m64c m32c f32c > $R/rows2.txt 2>&1; cut -c1-300 $R/rows2.txt
(timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_forward_casts_gpu.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"); tail -3 $R/gpu_tests.log
cd $OUT && tar czf call2.tgz r && rm -rf r
