# s38 call 4 (issue 18): main (one_op_local_casts on by default, the dispatcher-level ops)
# against e749b1a's package (gpu_pkgs/before: a cast per parameter), cold compile at 8, 32 and 64
# layers, one H200, torch 2.11, each row a fresh process with empty caches; main's 32 layers warm.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 300 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-330
}
ct main_d8_d32 $BASE --depths 8 32 --modes shardc --caches cold
ct before_d8_d32 $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold
ct main_d64 $BASE --depths 64 --modes shardc --caches cold
ct before_d64 $PWD/gpu_pkgs/before:$BASE --depths 64 --modes shardc --caches cold
cd $OUT && tar czf c4.tgz r && rm -rf r
