# call 1: the GPU tests this change and s66's last mend touch, then round 1
source docs/bench/compile_time/s67/common.sh
(timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_forward_casts_gpu.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"); tail -3 $R/gpu_tests.log
row before b8a 8 50 shardc-packed
row after a8a 8 50 shardc-packed
row before b64a 64 75 shardc-packed
row after a64a 64 75 shardc-packed
row after a32a 32 60 shardc-packed
row after f32a 32 50 fsdp2-compile
rows2 b8a a8a b64a a64a a32a f32a > $R/rows1.txt 2>&1; cut -c1-400 $R/rows1.txt
cd $OUT && tar czf call1.tgz r && rm -rf r
