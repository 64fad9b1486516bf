# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The device's .git said 1e78424; its working tree had 8b5c70a's change (the back-to-back step), so the code was 8b5c70a's.
# call6/ (one nvidia-h200 start), gpu_6.sh:
# s27 call 6 (issue 19): the back-to-back step prediction (StepPrediction.steady_s) on one H200 with the shipped h200 preset, then with the host probe's rescale (--refine-host)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
for v in plain refine; do
  echo "== predict $v $(date +%T)"
  extra=""; [ $v = refine ] && extra="--refine-host"
  timeout 200 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile shardc/planning/profiles/h200.json $extra --configs 1b:8:1,1b:8:2,1b:8:4,wide:8:2 --blocks-once --steps 10 --deadline-s 185 --out $R --name predict_b2b_$v > $R/predict_b2b_$v.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| fsdp" $R/predict_b2b_$v.md | head -4 | cut -c1-160
done
cd $OUT && tar czf c6.tgz r && rm -rf r
# call7/ (one nvidia-h200-x2 start, both GPUs), the run command itself:
source gpu_env.sh; R=$OUT/r; mkdir -p $R; git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; timeout 200 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile shardc/planning/profiles/h200.json --refine-host --configs 1b:8:1,1b:8:2,1b:8:4,wide:8:2 --blocks-once --steps 10 --deadline-s 185 --out $R --name predict_b2b_refine_w2 > $R/predict_b2b_refine_w2.log 2>&1; cd $OUT && tar czf c7.tgz r && rm -rf r
