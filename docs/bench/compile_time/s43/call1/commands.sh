# s43 call 1 (issue 18): packed, packed + plain inputs and FSDP2 + per-block compile, cold and
# warm at 8 and 32 layers (mode-major, round 1), then packed-plain and packed cold at 64 layers;
# one H200, torch 2.11, world 1, 1b config.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
md5sum benchmarks/train/modes.py >> $R/commit.txt
timeout 380 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 120 --out $R --name r1 --depths 8 32 --modes shardc-packed-plain shardc-packed fsdp2-compile --caches cold warm > $R/r1.log 2>&1; echo "r1 rc=$?"
rm -rf $R/*_caches
timeout 150 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 70 --out $R --name r1_64 --depths 64 --modes shardc-packed shardc-packed-plain --caches cold > $R/r1_64.log 2>&1; echo "r1_64 rc=$?"
rm -rf $R/*_caches
for f in r1 r1_64; do grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-120; done
