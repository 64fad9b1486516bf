# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The thirty-first session, one nvidia-h200 start: call 1 BUDGETS="11166914969 11703785881" bash gpu_parts.sh, call 2 BUDGETS="10920751988" bash gpu_parts.sh
# gpu_old/: git archive b2d1767 shardc benchmarks | tar -x -C gpu_old

# gpu_parts.sh
# s31 (issue 22, recompute per saved activation): the 1b config, 8 layers, batch 4, world 1, three budgets:
# main without the lever (gpu_old/: git archive of HEAD b2d1767) against the working tree with it (and the search's first prefix),
# alternating, each row its own torchrun, 5 timed steps after 2.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
ROOT=$PWD
for b in $BUDGETS; do
  for v in old new; do
    if [ $v = old ]; then D=$ROOT/gpu_old; else D=$ROOT; fi
    ( cd $D && PYTHONPATH=$D timeout 170 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b --budgets $b --fresh \
        --run-estimate-s 60 --run-timeout-s 160 --out $R/${v}_$b -- --n-layers 8 ) > $R/${v}_$b.log 2>&1
    echo "== $v $b"; grep -E "^\{" $R/${v}_$b.log | cut -c1-600; grep -E "Traceback|Error" $R/${v}_$b.log | head -3
  done
done
cd $OUT && tar czf c1.tgz r && rm -rf r
