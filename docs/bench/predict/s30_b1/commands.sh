# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The thirtieth session, calls 4 and 5 (two nvidia-h200 starts, D and E): gpu_4.sh, the same script each time

# gpu_4.sh
# s30 call 4 (issue 19): s29 call 5 again on another nvidia-h200 start (batch 1 of the 1b config, bf16 and FP8, each twice in one
# process, alternating, with s29's calibrated profile and the host rescale): the FP8 surplus over bf16 at batch 1 on one more start.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
timeout 420 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile docs/bench/predict/s29_calibrated/call1/h200_s29.json --refine-host --configs 1b:8:1:fp8,1b:8:1,1b:8:1:fp8,1b:8:1 --blocks-once --steps 20 --deadline-s 400 --out $R --name predict_s30_b1 > $R/predict_s30_b1.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s30_b1.md | head -8 | cut -c1-260
grep -iE "probe|rescale" $R/predict_s30_b1.log | head -5
cd $OUT && tar czf c4.tgz r && rm -rf r
