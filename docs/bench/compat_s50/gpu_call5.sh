# s50 call 5: the offload step-in-backward test after it runs under SDPA's math kernel with
# deterministic algorithms (Inductor row, twice).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for i in 1 2; do timeout 100 python3 -m pytest -m gpu "tests/gpu/test_offload_gpu.py::test_step_in_backward_equals_the_plain_offload_step[inductor]" -q -p no:cacheprovider 2>&1 | grep -v "^DEBUG" | grep "passed\|failed\|Error" | sed "s|^|run $i: |"; done
