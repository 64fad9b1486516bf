# s42 call 4c: the same machine right after 4b: the default shardc (cold, warm) and fsdp2-compile
# (cold) at 32 layers, the current package.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") > $R/commit.txt
timeout 75 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 70 --out $R --name default4 --depths 32 --modes shardc --caches cold warm > $R/default4.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches; grep -E "^\| *[0-9]+ \|" $R/default4.md | cut -c1-110
timeout 40 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 35 --out $R --name fsdp4 --depths 32 --modes fsdp2-compile --caches cold > $R/fsdp4.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches; grep -E "^\| *[0-9]+ \|" $R/fsdp4.md | cut -c1-110
