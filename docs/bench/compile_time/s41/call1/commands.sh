# s41 call 1 (issue 18): where the first step's time goes beyond shardc's stage lines: shardc
# and fsdp2-compile at 8 and 32 layers, cold then warm, one H200, torch 2.11, main 06cfeb7
# (with 4af67ec's benchmarks/compile_time.py, which records the first step's phases and torch's
# timed compile events).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
git log -1 --format=%H >> $R/commit.txt 2>/dev/null
for m in shardc fsdp2-compile; do
timeout 280 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 130 --out $R --name ph_$m --depths 8 32 --modes $m --caches cold warm > $R/ph_$m.log 2>&1; echo "$m rc=$?"
rm -rf $R/*_caches
grep -E "^\| *[0-9]+ \|" $R/ph_$m.md | cut -c1-200
done
cd $OUT && tar czf c1.tgz r && rm -rf r
