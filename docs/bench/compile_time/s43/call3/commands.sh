# s43 call 3 (issue 18): the benchmark imports Inductor before every mode's first-step timer
# (the fsdp2-compile setup imported it already; shardc's first step carried it). packed and
# FSDP2 + per-block compile at 8 and 32 layers, cold and warm; packed cold at 64 layers.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
md5sum benchmarks/compile_time.py >> $R/commit.txt
timeout 420 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 100 --out $R --name r4 --depths 8 32 --modes shardc-packed fsdp2-compile --caches cold warm > $R/r4.log 2>&1; echo "r4 rc=$?"
rm -rf $R/*_caches
timeout 90 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 80 --out $R --name r4_64 --depths 64 --modes shardc-packed --caches cold > $R/r4_64.log 2>&1; echo "r4_64 rc=$?"
rm -rf $R/*_caches; rm -rf $R/*_logs
for f in r4 r4_64; do grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-120; done
