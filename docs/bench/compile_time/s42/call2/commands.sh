# s42 call 2 (issue 18): the order of call 1 swapped (default shardc first on this machine, then
# shardc-packed), cold at 8 and 32 layers, each row a fresh process with empty caches; then step
# time and peak memory of both modes in one train_bench process (8 layers, then 32).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
ct() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  echo "== $name $(date +%T)"
  timeout $t python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  rm -rf $R/*_caches
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-110
}
tb() {  # name, timeout, layers, modes...
  local name=$1 t=$2 n=$3; shift 3
  echo "== $name $(date +%T)"
  timeout $t torchrun --nproc-per-node 1 benchmarks/train_bench.py --model 1b --n-layers $n --batch 4 --modes "$@" --steps 15 --warmup 3 --profile-steps 0 --no-dump-plan --out $R --name $name > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *(shardc|bound)" $R/$name.md | cut -c1-220
}
ct shardc2 110 --depths 8 32 --modes shardc --caches cold
ct packed2 110 --depths 8 32 --modes shardc-packed --caches cold
tb L8 140 8 shardc shardc-packed
tb L32 200 32 shardc-packed shardc
