# s42 call 4b: the same machine right after call 4: e3dec4f's package (calls 1-3, gpu_pkgs/before)
# then the current one again, packed, cold then warm at 32 and 8 layers.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
PYTHONPATH=$PWD/gpu_pkgs/before:$BASE timeout 110 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 100 --out $R --name before4 --depths 32 8 --modes shardc-packed --caches cold warm > $R/before4.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches; grep -E "^\| *[0-9]+ \|" $R/before4.md | cut -c1-110
timeout 100 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 100 --out $R --name main4 --depths 32 8 --modes shardc-packed --caches cold warm > $R/main4.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches; grep -E "^\| *[0-9]+ \|" $R/main4.md | cut -c1-110
