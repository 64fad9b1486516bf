# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# one nvidia-h200 start, the session's fourth call
# s28 call 4 (issue 19): FP8 (Float8Policy on Linear and Embedding) steps predicted back to back on one H200, shipped h200 preset with the host probe's rescale (--refine-host)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
timeout 250 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile shardc/planning/profiles/h200.json --refine-host --configs 1b:8:4:fp8,1b:8:2:fp8 --blocks-once --steps 10 --deadline-s 235 --out $R --name predict_fp8_b2b > $R/predict_fp8_b2b.log 2>&1; echo "rc=$?"
grep -E "^\|" $R/predict_fp8_b2b.md | head -8 | cut -c1-220
cd $OUT && tar czf c5.tgz r && rm -rf r
