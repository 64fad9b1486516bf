# s50 call 3: test_step_in_backward_equals_the_plain_offload_step[inductor] failed in call 2.
# Run it at main (52eeb44, twice) and with fce2fe2's shardc/ and tests/ (gpu_before/, before the
# symbolic stand-ins), alternated, on one machine start.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T="tests/gpu/test_offload_gpu.py::test_step_in_backward_equals_the_plain_offload_step"
one() { (cd $1 && timeout 200 python3 -m pytest -m gpu "$T" -q -p no:cacheprovider 2>&1 | grep -v "^DEBUG" | tail -3 | sed "s|^|$2: |"); }
one . "main 1"
one gpu_before "before"
one . "main 2"
