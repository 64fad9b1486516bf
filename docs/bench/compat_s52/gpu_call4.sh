# s52 call 4: the three GPU tests call 3 failed (tests/gpu/test_offload_gpu.py, peak budget),
# after the default step's swap moved onto the optimizer (a leak kept each optimizer alive).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
(nvidia-smi -L; find shardc tests -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum) > $OUT/versions.txt
timeout 400 python3 -m pytest -m gpu tests/gpu/test_offload_gpu.py -k "peak_budget_below" -q -rfEs -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "pytest rc=$?"
grep -v "^DEBUG" $OUT/gpu_tests.log | tail -8
