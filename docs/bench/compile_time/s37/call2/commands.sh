# s37 call 2: one nvidia-h200 start, torch 2.11. gpu_env.sh = docs/bench/predict/s21_default/commands.sh lines 2-6;
# gpu_pkgs/before/shardc = git archive 9759bc1 shardc; main = fa8f618 + a3a23ff's tree (checksums in commit.txt).
# s37 call 2 (issue 18): compile time at main (fa8f618 + a3a23ff: the attention estimate's is_causal
# from the schema; the analyses' body inlining no longer quadratic on torch 2.11's fx) against
# 9759bc1's package (gpu_pkgs/before), one H200, torch 2.11; plus FSDP2 + per-block compile at 64
# layers (its row timed out in call 1). Each row a fresh process, cold = empty caches.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
md5sum shardc/passes/body.py gpu_pkgs/before/shardc/passes/body.py >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 280 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-330
}
ct before_d64 $PWD/gpu_pkgs/before:$BASE --depths 64 --modes shardc --caches cold
ct main_d64 $BASE --depths 64 --modes shardc --caches cold warm
ct main_d8_d32 $BASE --depths 8 32 --modes shardc --caches cold warm
ct fsdp2_d64 $BASE --depths 64 --modes fsdp2-compile --caches cold
cd $OUT && tar czf c2.tgz r && rm -rf r
