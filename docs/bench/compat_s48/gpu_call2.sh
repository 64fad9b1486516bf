source gpu_env.sh
mkdir -p $OUT/r
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/r/pip.log 2>&1
timeout 560 python3 -m pytest -p no:cacheprovider -m gpu tests/gpu -rA --tb=line -v --deselect tests/gpu/test_checkpoint_sdpa_gpu.py > $OUT/r/gpu_all.log 2>&1
echo rc=$? >> $OUT/r/gpu_all.log
tail -n 5 $OUT/r/gpu_all.log
