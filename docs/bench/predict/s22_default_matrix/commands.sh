# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_3.sh (call 3)
# s22 call 3 (issue 19): default shardc (no CUDA graphs, no budget) predicted against measured on the matrix's two-GPU rows not yet run in default mode: the wide config (FSDP 2, batch 1/2/4), HSDP 2x1 and 1x2, FSDP 1 x TP 2; profile: the twenty-first session's two-GPU calibration
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R/m
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/s21_default/2xh200_s21.json
echo "== matrix $(date +%T)"
timeout 560 python3 benchmarks/predict_matrix.py --parts fsdp2-wide,hsdp2x1,hsdp1x2,tp2 --profile $P --out $R/m --deadline-s 545 -- --blocks-once --steps 10 > $R/m/matrix.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| " $R/m/predict_matrix.md | cut -c1-220 | head -20
cd $OUT && tar czf c3.tgz r && rm -rf r
