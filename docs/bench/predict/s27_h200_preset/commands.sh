# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# calls 4 and 5 of the session (the nvidia-h200-x2 start of ../../budget/offload_release_2xh200_s27, after call 3)
# call4/: gpu_4.sh
# s27 call 4 (issue 19): steps predicted with the shipped h200 preset (profile format 10) against measured on one H200 (same x2 start, GPU 0 alone)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== predict $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 290 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile shardc/planning/profiles/h200.json --configs 1b:8:1,1b:8:2,1b:8:4,1b:16:4,wide:8:2 --blocks-once --steps 10 --deadline-s 275 --out $R --name predict_h200 > $R/predict_h200.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| " $R/predict_h200.md | head -12 | cut -c1-220
cd $OUT && tar czf c4.tgz r && rm -rf r
# call5/: the run command itself:
source gpu_env.sh; R=$OUT/r; mkdir -p $R; git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; timeout 280 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile shardc/planning/profiles/h200.json --configs 1b:8:1,1b:8:2,1b:8:4,wide:8:2 --blocks-once --steps 10 --deadline-s 265 --out $R --name predict_h200_w2 > $R/predict_h200_w2.log 2>&1; cd $OUT && tar czf c5.tgz r && rm -rf r
