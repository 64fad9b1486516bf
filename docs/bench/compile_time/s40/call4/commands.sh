# s40 call 4 (issue 18): cold then warm (the cold run's cache directories reused, a fresh
# process) at 8 and 32 layers, main, one H200, torch 2.11.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
timeout 330 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 150 --out $R --name warm --depths 8 32 --modes shardc --caches cold warm > $R/warm.log 2>&1; echo "rc=$?"
rm -rf $R/*_caches
grep -E "^\| *[0-9]+ \|" $R/warm.md | cut -c1-260
cd $OUT && tar czf c4.tgz r && rm -rf r
