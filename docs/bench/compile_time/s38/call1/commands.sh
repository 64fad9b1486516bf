# s38 call 1 (issue 18): the one-rank casts as one op per bucket (one_op_bucket_copies, which now
# also lowers world 1's elided casts as shardc::cast_into): cold compile at 8, 32, 64 layers,
# shardc vs shardc-oneop, one H200, torch 2.11, each row a fresh process with empty caches.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
python3 gpu_fe.py > $R/foreach.log 2>&1; cat $R/foreach.log
ct() {  # name, args...
  local name=$1; shift
  echo "== $name $(date +%T)"
  timeout 290 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-330
}
ct d8_d32 --depths 8 32 --modes shardc shardc-oneop --caches cold
ct d64 --depths 64 --modes shardc-oneop shardc --caches cold
cd $OUT && tar czf c1.tgz r && rm -rf r
