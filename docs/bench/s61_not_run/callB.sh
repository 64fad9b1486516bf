# s61 call B (issue 19): a second start with the s60 calibration code: calibrate fresh, then rows not run with it (32 layers batch 1, wide, sequence 8192, FP8 batch 1)
source docs/bench/s61_not_run/prelude.sh
timeout 200 python3 -m shardc calibrate --out $R/h100_s61.json > $R/calibrate_s61.log 2>&1; echo "cal rc=$? $(date +%T)"
grep -E "compiled graphs|host \(fit|FP8 host|probe" $R/calibrate_s61.log | cut -c1-300
P=$R/h100_s61.json
[ -f $P ] && timeout 380 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:1:fp8,1b:32:1,wide:8:1,1b:8:1:s8192,wide:16:2,1b:16:4 --blocks-once --steps 10 --deadline-s 360 --out $R --name predict_s61 > $R/predict_s61.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s61.md | head -12 | cut -c1-220
cd $OUT && tar czf callB.tgz r && rm -rf r
