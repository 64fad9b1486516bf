# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# Calls 3-4 of the machine start in ../../budget/curve_wide_2xh200_s25/commands.sh; call 4 carried call 3's p1.json as p1_s25.json

# gpu_3.sh
# s25 call 3 (issue 19): two calibrations (profile format 10, host fits from interleaved rounds with their spread) on two H200s, one after the other, then their host terms compared with each other and with the s23 probe profile
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
for i in 1 2; do echo "== calibrate $i $(date +%T)"; /usr/bin/time -v timeout 270 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/p$i.json > $R/calibrate_$i.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/calibrate_$i.log; done
python3 scripts/compare_host_fits.py $R/p1.json $R/p2.json docs/bench/predict/s23_probe/2xh200_s23.json > $R/compare.txt 2>&1; cat $R/compare.txt | head -60
cd $OUT && tar czf c3.tgz r && rm -rf r

# gpu_4.sh
# s25 call 4 (issue 19): steps predicted with the format-10 profile of call 3 (p1_s25.json, carried) against measured, two H200s: 1b 8 layers at batch 1, 2, 4 and 4 with FP8, then wide 8 layers batch 2 (plain, then with the host refinement)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=p1_s25.json
echo "== predict $(date +%T)"
timeout 280 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:8:1,1b:8:2,1b:8:4,1b:8:4:fp8,wide:8:2 --blocks-once --steps 10 --deadline-s 265 --out $R --name predict_C > $R/predict_C.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| " $R/predict_C.md | head -12 | cut -c1-220
echo "== predict refined $(date +%T)"
timeout 250 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --refine-host --configs 1b:8:1,1b:8:2,1b:8:4,wide:8:2 --blocks-once --steps 10 --deadline-s 235 --out $R --name predict_CR > $R/predict_CR.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| " $R/predict_CR.md | head -12 | cut -c1-220
cd $OUT && tar czf c4.tgz r && rm -rf r
