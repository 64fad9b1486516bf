# s43 call 2 (issue 18): rounds 2 and 3, cold only: FSDP2 + per-block compile and packed at 32
# and 8 layers, packed at 64 (round 2); packed at 8 and 32, FSDP2 at 32 (round 3).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
timeout 330 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 100 --out $R --name r2 --depths 32 8 --modes fsdp2-compile shardc-packed --caches cold > $R/r2.log 2>&1; echo "r2 rc=$?"
rm -rf $R/*_caches
timeout 100 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 90 --out $R --name r2_64 --depths 64 --modes shardc-packed --caches cold > $R/r2_64.log 2>&1; echo "r2_64 rc=$?"
rm -rf $R/*_caches
timeout 120 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 60 --out $R --name r3 --depths 32 --modes fsdp2-compile --caches cold > $R/r3.log 2>&1; echo "r3 rc=$?"
rm -rf $R/*_caches; rm -rf $R/*_logs
for f in r2 r2_64 r3; do grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-120; done
