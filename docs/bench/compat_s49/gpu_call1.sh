# s49 call 1 (one H200, torch 2.11): the checkpointed transformers decoder through a dynamic
# recompile (new test), and the four existing checkpoint-SDPA rows, after the member bodies.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/r
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/r/versions.txt 2>&1
(find shardc tests -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/shardc+tests/") >> $OUT/r/versions.txt
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_checkpoint_sdpa_gpu.py -rA --tb=short > $OUT/r/sdpa.log 2>&1
tail -12 $OUT/r/sdpa.log; cat $OUT/r/versions.txt
