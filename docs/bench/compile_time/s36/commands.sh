# s36: one nvidia-h200 start (torch 2.11). gpu_env.sh = docs/bench/predict/s21_default/commands.sh lines 2-6.
# gpu_pkgs/before/shardc = git archive a8e18f3 shardc; gpu_pkgs/opaque/shardc = branch opaque36 at e2ce481 merged with main c388a1b,
# with ShardcOptions.opaque_body_calls defaulted to True (measurement only); main = c388a1b's tree. Checksums in commit.txt.
# s36 (issue 18): compile time, world 1, 1b config, each depth and variant its own process with
# empty caches (cold), then warm (the cold run's caches). Variants: before = main a8e18f3's
# package (gpu_pkgs/before), main = c388a1b (Dynamo per-block cuts), opaque = branch opaque36
# e2ce481 merged with main c388a1b, opaque_body_calls defaulted to True (gpu_pkgs/opaque).
# The device's .git is stale: commit.txt has checksums of the packages.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
for v in before opaque; do (cd gpu_pkgs/$v && find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/$v/") >> $R/commit.txt; done
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
md5sum shardc/sharding/blocks.py gpu_pkgs/*/shardc/sharding/blocks.py >> $R/commit.txt
BASE=$PYTHONPATH
for d in 8 32; do
  for v in opaque main before; do
    if [ $v = main ]; then export PYTHONPATH=$BASE; else export PYTHONPATH=$PWD/gpu_pkgs/$v:$BASE; fi
    echo "== $v d$d $(date +%T)"
    timeout 200 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths $d --modes shardc --caches cold warm --steps 2 --timeout-s 150 --out $R --name ct_${v}_d$d > $R/ct_${v}_d$d.log 2>&1; echo "rc=$? $(date +%T)"
    grep -E "^\| *$d" $R/ct_${v}_d$d.md | cut -c1-260
  done
done
export PYTHONPATH=$BASE
cd $OUT && tar czf ct36.tgz r && rm -rf r
