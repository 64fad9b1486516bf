# s45 call 1 (issue 18): main with the region compile's collector pause (new) at 8, 32, 64
# layers cold; e0c2008 (before both pauses, gpu_before/) and new at 64 cold, alternated;
# FSDP2 + per-block compile at 32 cold; new at 32 cold + warm.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/new/") >> $R/commit.txt
(cd gpu_before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
md5sum benchmarks/compile_time.py gpu_before/benchmarks/compile_time.py >> $R/commit.txt
B="--nproc 1 --model 1b --steps 3 --caches cold"
timeout 190 python3 benchmarks/compile_time.py $B --timeout-s 75 --out $R --name a --depths 8 32 64 --modes shardc-packed > $R/a.log 2>&1; echo "a rc=$?"
rm -rf $R/*_caches
(cd gpu_before && PYTHONPATH=$PWD timeout 75 python3 benchmarks/compile_time.py $B --no-prime --timeout-s 70 --out $R --name old64 --depths 64 --modes shardc-packed > $R/old64.log 2>&1; echo "old64 rc=$?")
rm -rf $R/*_caches
timeout 75 python3 benchmarks/compile_time.py $B --no-prime --timeout-s 70 --out $R --name new64 --depths 64 --modes shardc-packed > $R/new64.log 2>&1; echo "new64 rc=$?"
rm -rf $R/*_caches
timeout 60 python3 benchmarks/compile_time.py $B --no-prime --timeout-s 55 --out $R --name f --depths 32 --modes fsdp2-compile > $R/f.log 2>&1; echo "f rc=$?"
rm -rf $R/*_caches
timeout 110 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --no-prime --timeout-s 60 --out $R --name w --depths 32 --modes shardc-packed --caches cold warm > $R/w.log 2>&1; echo "w rc=$?"
rm -rf $R/*_caches; rm -rf $R/*_logs
for f in a old64 new64 f w; do grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-160; done
