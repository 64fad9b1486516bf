# s73 call 5 (issue 19): predict_step's two rows on main with the split unpack and the body's
# gradient cast (the predicted peak and step against the measured ones).
source docs/bench/s61_not_run/prelude.sh
timeout 230 torchrun --nproc-per-node 1 benchmarks/predict_step.py --configs 1b:16:4,1b:8:2 \
  --blocks-once --steps 10 --deadline-s 210 --out $R --name predict_s73 > $R/predict_s73.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s73.md | head -6 | cut -c1-260
cd $OUT && tar czf call5.tgz r && rm -rf r
