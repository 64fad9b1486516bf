# s38 call 5: the GPU tests of shardc's compiled regions under CUDA graphs (world 1, two blocks,
# bf16: one-rank casts one shardc::cast_into per bucket by default now), at main.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc tests -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main shardc+tests/") >> $R/commit.txt
timeout 230 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_cudagraphs_gpu.py -k "one_rank_casts or records_and_trains" > $R/gpu_tests.log 2>&1; echo "rc=$?"
grep -E "passed|failed|FAILED|ERROR" $R/gpu_tests.log | tail -8 | cut -c1-300
cd $OUT && tar czf c5.tgz r && rm -rf r
