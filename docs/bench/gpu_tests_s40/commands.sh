# s40 call 3: the one-GPU tests of compiled regions (CUDA graphs, checkpointed SDPA, activation
# offload) at 75b76be's code (shardc+tests checksum in commit.txt), same machine start as call 2.
source gpu_env.sh; R=$OUT/r; mkdir -p $R; nvidia-smi -L > $R/commit.txt
(find shardc tests -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main shardc+tests/") >> $R/commit.txt
timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py tests/gpu/test_checkpoint_sdpa_gpu.py tests/gpu/test_activation_offload_gpu.py > $R/gpu_tests.log 2>&1; echo "rc=$?"
cd $OUT && tar czf c3.tgz r && rm -rf r
