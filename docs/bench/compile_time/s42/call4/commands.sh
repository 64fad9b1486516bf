# s42 call 4 (issue 18): shardc-packed after the per-block trace cuts (a compile-once block
# counts its eager forward itself, no forward hooks; one static check per described tensor),
# cold then warm at 8 and 32 layers; one H200, torch 2.11, world 1, 1b config, fresh machine.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
timeout 200 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 120 --out $R --name packed4 --depths 32 8 --modes shardc-packed --caches cold warm > $R/packed4.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches
grep -E "^\| *[0-9]+ \|" $R/packed4.md | cut -c1-110
