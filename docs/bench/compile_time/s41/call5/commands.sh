# s41 call 5 (issue 18): main 79f5b56 (parameter reads' constants in their code: 6 fewer guards
# per parameter) against 06cfeb7's package (gpu_pkgs/before), cold then warm at 8 and 32 layers,
# one H200, torch 2.11, each row a fresh process; two rounds, before/main then main/before.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 170 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 100 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  rm -rf $R/*_caches
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-120
}
ct before_1 $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold warm
ct main_1 $BASE --depths 8 32 --modes shardc --caches cold warm
ct main_2 $BASE --depths 8 32 --modes shardc --caches cold warm
ct before_2 $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold warm
cd $OUT && tar czf c5.tgz r && rm -rf r
