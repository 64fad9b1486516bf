# s71 call A (issue 19): the step and peak predictions for the packed default (pack_blocks on since
# s70's 6ee38d6; every earlier predicted-vs-measured row was made with per-parameter reads).
# One GPU, world 1, the shipped preset for this GPU; plan_vs_measured.py plans the same runs on the CPU.
source docs/bench/s61_not_run/prelude.sh
timeout 420 torchrun --nproc-per-node 1 benchmarks/predict_step.py --configs 1b:16:1,1b:32:1,1b:8:2,1b:16:4,wide:8:2 \
  --blocks-once --steps 10 --deadline-s 390 --out $R --name predict_s71a > $R/predict_s71a.log 2>&1; echo "pred rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s71a.md | head -9 | cut -c1-260
cd $OUT && tar czf callA.tgz r && rm -rf r
