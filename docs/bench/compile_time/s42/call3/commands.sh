# s42 call 3 (issue 18): shardc-packed again, cold then warm at 8, 32 and 64 layers (a third
# sample of the cold ratio after calls 1 and 2), the same machine as call 2.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
timeout 290 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 150 --out $R --name packed3 --depths 8 32 64 --modes shardc-packed --caches cold warm > $R/packed3.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches
grep -E "^\| *[0-9]+ \|" $R/packed3.md | cut -c1-110
