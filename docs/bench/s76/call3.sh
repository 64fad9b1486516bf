# s76 call 3: checkpointed attention without dropout on CUDA (the graph-safe form of
# passes/body_rng.py): the helper's check, the GPU checkpointing tests, and issue 18's compile
# rows with every block checkpointed (shardc-ac, 8 and 32 layers, against fsdp2-compile-ac at 32),
# then the rest of tests/gpu as time allows.
source docs/bench/s61_not_run/prelude.sh
(PYTHONPATH=$PWD:$PWD/tests timeout 150 python3 docs/bench/s76/ckpt_sdpa_cuda.py --keep-wrappers > $R/ckpt_sdpa_cuda.log 2>&1); echo "cuda check rc=$? $(date +%T)"
grep -v Warning $R/ckpt_sdpa_cuda.log | grep -E "PASS|FAIL|RESULT|rror" | tail -20
(PYTHONPATH=$PWD:$PWD/tests timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_checkpoint_sdpa_gpu.py -rs > $R/gpu_ckpt.log 2>&1); echo "gpu ckpt rc=$? $(date +%T)"
tail -15 $R/gpu_ckpt.log
B="--nproc 1 --model 1b --steps 3 --timeout-s 120 --no-prime"
run a8 8 80 shardc-ac cold
run a32 32 110 shardc-ac cold
run f32ac 32 90 fsdp2-compile-ac cold
rows a8 a32 f32ac > $R/rows.txt 2>&1; cut -c1-500 $R/rows.txt
grep -h -i "inline\|bod" $R/a8.log | head -5
(PYTHONPATH=$PWD:$PWD/tests timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu -rs --deselect tests/gpu/test_checkpoint_sdpa_gpu.py -x > $R/gpu_rest.log 2>&1); echo "gpu rest rc=$? $(date +%T)"
tail -8 $R/gpu_rest.log
cd $OUT && tar czf call3.tgz r && rm -rf r
