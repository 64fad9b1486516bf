# s37 call 1 (one nvidia-h200 start, torch 2.11, main 9759bc1 plus scripts/profile_compile.py's --device cuda (committed in fa8f618)). gpu_env.sh = docs/bench/predict/s21_default/commands.sh lines 2-6.
# The compile_time run hit its 330 s limit during fsdp2-compile at 64 layers (no row).
# s37 call 1 (issue 18): where the compile time goes on one H200 (torch 2.11), main with
# scripts/profile_compile.py's --device cuda; then the rows not run before: 64 layers, and FSDP2 +
# per-block compile at 32 and 64 layers in the same run as shardc.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; python3 -c "import torch; print(torch.__version__)" >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
echo "== profile $(date +%T)"
timeout 300 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 8 32 --out $R/prof > $R/profile.log 2>&1; echo "rc=$? $(date +%T)"
tail -25 $R/profile.log
echo "== compile_time $(date +%T)"
timeout 330 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths 32 64 --modes shardc fsdp2-compile --caches cold warm --steps 2 --timeout-s 150 --out $R --name ct_d32_d64 > $R/ct_d32_d64.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| *(32|64)" $R/ct_d32_d64.md | cut -c1-300
cd $OUT && tar czf c1.tgz r && rm -rf r
