# s43 call 4 (issue 18): packed cold at 8, 32 and 64 layers again on the same machine (call 3's
# 8-layer row was the machine's first process), then FSDP2 + per-block compile cold at 32.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
md5sum benchmarks/compile_time.py >> $R/commit.txt
timeout 250 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 80 --out $R --name r5 --depths 8 32 64 --modes shardc-packed --caches cold > $R/r5.log 2>&1; echo "r5 rc=$?"
rm -rf $R/*_caches
timeout 80 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 70 --out $R --name r5_fsdp --depths 32 --modes fsdp2-compile --caches cold > $R/r5_fsdp.log 2>&1; echo "r5_fsdp rc=$?"
rm -rf $R/*_caches; rm -rf $R/*_logs
for f in r5 r5_fsdp; do grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-120; done
