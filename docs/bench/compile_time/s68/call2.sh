# call 2 (the same warm machine): the third round's rows, then the GPU tests at this code
# (forward casts with the dataclass entry of s67, CUDA graphs) and a profile
source docs/bench/compile_time/s68/common.sh
row after a32b 32 60 shardc-packed
row after f32b 32 50 fsdp2-compile
row before b8c 8 50 shardc-packed
row after a8c 8 50 shardc-packed
row after a64c 64 75 shardc-packed
row before b64c 64 75 shardc-packed
rows2 a32b f32b b8c a8c a64c b64c > $R/rows2.txt 2>&1; cut -c1-300 $R/rows2.txt
# a cProfile (wall clock) of the after tree's 8-layer first step: where the time outside torch's
# compile events goes (forward 7.5 s against Dynamo's 6.5 s of compile in s67)
(timeout 120 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 8 --pack-blocks \
  --out $R/prof > $R/prof.log 2>&1; echo "profile rc=$?"); tail -22 $R/prof.log | cut -c1-120
(timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_forward_casts_gpu.py -rA > $R/gpu_tests.log 2>&1; echo "gpu tests rc=$?"); tail -3 $R/gpu_tests.log
cd $OUT && tar czf call2.tgz r && rm -rf r
