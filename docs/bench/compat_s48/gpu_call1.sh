source gpu_env.sh
mkdir -p $OUT/r
git log --oneline -1 > $OUT/r/commit.txt
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $OUT/r/versions.txt 2>&1
pip list 2>/dev/null | grep -i kernels >> $OUT/r/versions.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_checkpoint_sdpa_gpu.py -rA --tb=short > $OUT/r/sdpa.log 2>&1
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/r/pip.log 2>&1
timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rA --tb=line --deselect tests/gpu/test_checkpoint_sdpa_gpu.py > $OUT/r/gpu_all.log 2>&1
tail -3 $OUT/r/sdpa.log $OUT/r/gpu_all.log
