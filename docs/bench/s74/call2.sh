# s74 call 2 (issue 19): the three s72 predict_step rows s73 did not rerun, on main after s73's
# passes (predicted step and peak against the measured ones, world 1, the shipped h100 preset).
source docs/bench/s61_not_run/prelude.sh
timeout 280 torchrun --nproc-per-node 1 benchmarks/predict_step.py --configs 1b:16:1,1b:32:1,wide:8:2 \
  --blocks-once --steps 10 --deadline-s 260 --out $R --name predict_s74 > $R/predict_s74.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s74.md | head -6 | cut -c1-300
cd $OUT && tar czf call2.tgz r && rm -rf r
