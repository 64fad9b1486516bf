# s72 call 2 (issue 19): predict_step's rows again after s71's cleanup between rows (gc after
# Dynamo's reset); each row now records what it left allocated and names what still holds it.
source docs/bench/s61_not_run/prelude.sh
timeout 290 torchrun --nproc-per-node 1 benchmarks/predict_step.py --configs 1b:16:1,1b:32:1,1b:8:2,1b:16:4,wide:8:2 \
  --blocks-once --steps 10 --deadline-s 270 --out $R --name predict_s72 > $R/predict_s72.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s72.md | head -9 | cut -c1-260
grep -E "still allocated" $R/predict_s72.log | cut -c1-600
cd $OUT && tar czf call2.tgz r && rm -rf r
