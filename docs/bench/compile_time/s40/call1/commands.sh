# s40 call 1 (issue 18): main (Dynamo's per-block instructions 3,440 -> 2,838; equal bodies shared)
# against 226a39c's package (gpu_pkgs/before), cold compile at 8 and 32 layers, one H200,
# torch 2.11, each row a fresh process with empty caches; two alternating pairs.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 140 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 120 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  rm -rf $R/*_caches
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-220
}
for i in 1 2; do
  ct before_$i $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold
  ct main_$i $BASE --depths 8 32 --modes shardc --caches cold
done
cd $OUT && tar czf c1.tgz r && rm -rf r
