# s39 calls 1-2 (issue 18): main (fewer Dynamo instructions per block, the planner's per-body
# caches) against 6735ce2's package (gpu_pkgs/before), cold compile at 8 and 32 layers, one H200,
# torch 2.11, each row a fresh process with empty caches; three alternating pairs, since one
# process's Dynamo trace varies by about 40% between identical rows on this host (s37).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(cd gpu_pkgs/before && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/before/") >> $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
BASE=$PYTHONPATH
ct() {  # name, pythonpath, args...
  local name=$1 pp=$2; shift 2
  echo "== $name $(date +%T)"
  PYTHONPATH=$pp timeout 200 python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 2 --timeout-s 120 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-200
}
for i in 1 2 3; do
  ct before_$i $PWD/gpu_pkgs/before:$BASE --depths 8 32 --modes shardc --caches cold
  ct main_$i $BASE --depths 8 32 --modes shardc --caches cold
done
cd $OUT && tar czf c1.tgz r && rm -rf r

# What happened: call 1 ran out of its 600 s after the three "before" pairs' rows and main_1..3's
# rows were run, but only before/ came back (too many files under $OUT). Call 2, on the same
# machine start right after, ran main's three rows again (main/), with this command:
#   source gpu_env.sh; R=$OUT/r; mkdir -p $R; nvidia-smi -L > $R/commit.txt
#   (find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
#   for i in 1 2 3; do PYTHONPATH=$PYTHONPATH timeout 150 python3 benchmarks/compile_time.py \
#     --nproc 1 --model 1b --steps 2 --timeout-s 120 --out $R --name main_$i --depths 8 32 \
#     --modes shardc --caches cold > $R/main_$i.log 2>&1; rm -rf $R/*_caches; done
# So the "before" rows all ran before main's, not alternating. main's checksum (commit.txt,
# device en_US collation) is ca172b6's shardc tree.
