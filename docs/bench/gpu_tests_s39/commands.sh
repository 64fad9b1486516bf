# s39 call 5: the one-GPU tests of compiled regions (CUDA graphs, checkpointed SDPA, activation
# offload) at ca172b6's code, after the Dynamo and planner changes.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc tests -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main shardc+tests/") >> $R/commit.txt
timeout 450 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_checkpoint_sdpa_gpu.py tests/gpu/test_activation_offload_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -8 | cut -c1-300
cd $OUT && tar czf c5.tgz r && rm -rf r
