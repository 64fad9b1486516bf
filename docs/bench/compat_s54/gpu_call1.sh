# s54 call 1: every GPU test on one H200 with plain_inputs=True as the default (eea830e)
# 
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1
(nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; find shardc tests -name "*.py" | LC_ALL=C sort | xargs md5sum | md5sum) > $OUT/versions.txt
timeout 560 python3 -m pytest -m gpu tests/gpu -q -rfEs -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "pytest rc=$?"
tail -30 $OUT/gpu_tests.log
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null; git status --short >> $OUT/commit.txt
