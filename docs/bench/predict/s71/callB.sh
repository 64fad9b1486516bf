# s71 call B: predict_step's measured peaks of the packed default were 1.5-6.1 GiB over the
# plan after the first configuration (call A): the previous model's memory still allocated?
source docs/bench/s61_not_run/prelude.sh
for pack in 1 0; do
  PACK=$pack timeout 200 torchrun --nproc-per-node 1 docs/bench/predict/s71/leak_probe.py --configs 1b:8:1,1b:4:1,1b:4:1 \
    --blocks-once --steps 3 --warmup 2 --out $R --name leak$pack > $R/leak$pack.log 2>&1; echo "pack=$pack rc=$?"
  grep -E "PROBE|^\| fsdp" $R/leak$pack.log | cut -c1-250 | head -40
done
cd $OUT && tar czf callB.tgz r && rm -rf r
