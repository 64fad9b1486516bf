# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_5.sh (call 5, one nvidia-h200 start; ran main 85dda71's code: the diff's hash equals git diff 9f8050e 85dda71 over the modified files: commit.txt)
# s23 call 5 (issue 22): the world-1 CPU-offload GPU tests on main with alloc23 (the peak model's CUDA allocator blocks and cuBLAS workspaces), the GRAD_D2H host-value mark and trade23
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload gpu tests $(date +%T)"
timeout 190 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/test_offload_gpu.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "AssertionError:|passed|failed" $R/test_offload_gpu.log | tail -4
cd $OUT && tar czf c5.tgz r && rm -rf r
