# s45 call 2 (issue 18): e0c2008 (gpu_before/, before both collector pauses) and main (new)
# alternated at 64 layers cold, twice, then new at 8 layers; results packed in one archive.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt; nproc >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/new/") >> $R/commit.txt
(cd gpu_before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
B="--nproc 1 --model 1b --steps 3 --caches cold --timeout-s 70"
python3 -c "import torch; torch.ones(1, device='cuda')"  # the machine's first CUDA process
timeout 75 python3 benchmarks/compile_time.py $B --out $R --name prime8 --depths 8 --modes shardc-packed > $R/prime8.log 2>&1; echo "prime8 rc=$?"
rm -rf $R/*_caches
for i in 1 2; do
  (cd gpu_before && PYTHONPATH=$PWD timeout 75 python3 benchmarks/compile_time.py $B --no-prime --out $R --name old64_$i --depths 64 --modes shardc-packed > $R/old64_$i.log 2>&1; echo "old64_$i rc=$?")
  rm -rf $R/*_caches
  timeout 75 python3 benchmarks/compile_time.py $B --no-prime --out $R --name new64_$i --depths 64 --modes shardc-packed > $R/new64_$i.log 2>&1; echo "new64_$i rc=$?"
  rm -rf $R/*_caches
done
timeout 60 python3 benchmarks/compile_time.py $B --no-prime --out $R --name new8 --depths 8 --modes shardc-packed > $R/new8.log 2>&1; echo "new8 rc=$?"
rm -rf $R/*_caches $R/*_logs
for f in prime8 old64_1 new64_1 old64_2 new64_2 new8; do echo "$f $(grep -E "^\| *[0-9]+ \|" $R/$f.md | cut -c1-300)"; done
cd $OUT && tar czf r.tgz r && rm -rf r
