# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The thirty-second session: call 1 (one nvidia-h200 start) bash gpu_tests.sh at main 24c296a; call 2 (another start) bash gpu_ck.sh after the test's count per body call

# gpu_tests.sh
# s32: the GPU test suite on one H200 at main (TransformerEngine is not installed there: its tests skip), each file its own pytest process.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
python3 -c "import pytest; print('pytest', pytest.__version__)" >> $R/commit.txt 2>&1
for f in test_offload_gpu test_activation_offload_gpu test_cudagraphs_gpu test_fp8_gpu test_checkpoint_sdpa_gpu test_host_rates_gpu test_te_gpu test_te_fp8_params; do
  echo "== $f $(date +%T)"
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/$f.py > $R/$f.log 2>&1
  echo "rc=$?"; tail -2 $R/$f.log | cut -c1-300
done
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_ck.sh
# s32: the checkpointed-SDPA GPU test again after counting the recomputed kernel per body call (one H200).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_checkpoint_sdpa_gpu.py > $R/test_checkpoint_sdpa_gpu.log 2>&1
echo "rc=$?"; tail -3 $R/test_checkpoint_sdpa_gpu.log | cut -c1-300
cd $OUT && tar czf c1.tgz r && rm -rf r
