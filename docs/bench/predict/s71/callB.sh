# s71 call B: predict_step's measured peaks of the packed default were 1.5-6.1 GiB over the
# plan after the first configuration (call A): the previous model's memory still allocated?
# (Cut to one process, packed, for the device time left.)
source docs/bench/s61_not_run/prelude.sh
PACK=1 timeout 150 torchrun --nproc-per-node 1 docs/bench/predict/s71/leak_probe.py --configs 1b:8:1,1b:4:1 \
  --blocks-once --steps 2 --warmup 1 --out $R --name leak1 > $R/leak1.log 2>&1; echo "rc=$?"
grep -E "PROBE|^\| fsdp" $R/leak1.log | cut -c1-250 | head -40
cd $OUT && tar czf callB.tgz r && rm -rf r
