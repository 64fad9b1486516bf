# gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6)
# one nvidia-h200 start, four calls, main 5000480 (commit.txt in each callN/)
# call1/: gpu_1.sh
# s29 call 1 (issue 19): calibrate this H200 (FP8 host terms now fitted over two depths), then bf16 and FP8 steps predicted back to back with that profile, 1b 8 layers batch 2 and 4
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 240 python -m shardc calibrate --out $R/h200_s29.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/calibrate.log
P=$R/h200_s29.json; [ -f $P ] || P=shardc/planning/profiles/h200.json
echo "== predict with $P $(date +%T)"
timeout 300 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:8:2:fp8,1b:8:4:fp8,1b:8:2,1b:8:4 --blocks-once --steps 10 --deadline-s 285 --out $R --name predict_s29 > $R/predict_s29.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s29.md | head -10 | cut -c1-240
cd $OUT && tar czf c1.tgz r && rm -rf r
# call2/: gpu_2.sh
# s29 call 2 (issue 19): with call 1's calibrated profile, 1b at 16 and 32 layers batch 4 and wide 8 layers batch 2, bf16, predicted back to back
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/s29_calibrated/call1/h200_s29.json
timeout 420 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile $P --configs 1b:16:4,wide:8:2,1b:32:4,1b:8:1 --blocks-once --steps 10 --deadline-s 400 --out $R --name predict_s29_depth > $R/predict_s29_depth.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s29_depth.md | head -8 | cut -c1-240
cd $OUT && tar czf c2.tgz r && rm -rf r
# call3/: the run command itself
source gpu_env.sh; R=$OUT/r; mkdir -p $R; git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt; timeout 300 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile docs/bench/predict/s29_calibrated/call1/h200_s29.json --refine-host --configs 1b:8:1,1b:8:2,wide:8:1 --blocks-once --steps 10 --deadline-s 285 --out $R --name predict_s29_refine > $R/predict_s29_refine.log 2>&1; cd $OUT && tar czf c3.tgz r && rm -rf r
# call4/: the run command itself
source gpu_env.sh; R=$OUT/r; mkdir -p $R; git log --oneline -1 > $R/commit.txt; git status --short >> $R/commit.txt; timeout 330 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile docs/bench/predict/s29_calibrated/call1/h200_s29.json --refine-host --configs 1b:16:4:fp8,wide:8:2:fp8,1b:8:1:fp8,wide:8:4 --blocks-once --steps 10 --deadline-s 315 --out $R --name predict_s29_fp8more > $R/predict_s29_fp8more.log 2>&1; cd $OUT && tar czf c4.tgz r && rm -rf r
# call5/: gpu_5.sh (a second nvidia-h200 start)
# s29 call 5 (issue 19): batch 1 of the 1b config repeated (bf16 and FP8, each twice in one process, alternating), with call 1's profile and the host rescale, to tell the model's FP8 host error from the run-to-run spread
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
timeout 400 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile docs/bench/predict/s29_calibrated/call1/h200_s29.json --refine-host --configs 1b:8:1:fp8,1b:8:1,1b:8:1:fp8,1b:8:1 --blocks-once --steps 20 --deadline-s 380 --out $R --name predict_s29_b1 > $R/predict_s29_b1.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/predict_s29_b1.md | head -6 | cut -c1-240
cd $OUT && tar czf c5.tgz r && rm -rf r
# call6/: gpu_6.sh (a third nvidia-h200 start)
# s29 call 6 (issue 19): the kernels the device runs per step at batch 1, FP8 against bf16 (profiled steps kept as traces), to compare with the cost model's 356/328 and 106/157 kernel groups
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
timeout 300 torchrun --nproc-per-node 1 benchmarks/predict_step.py --profile docs/bench/predict/s29_calibrated/call1/h200_s29.json --refine-host --configs 1b:8:1:fp8,1b:8:1 --blocks-once --steps 10 --deadline-s 280 --keep-traces $R/traces --out $R --name predict_s29_kernels > $R/predict_s29_kernels.log 2>&1; echo "rc=$? $(date +%T)"
ls -la $R/traces | head; du -sh $R/traces
cd $OUT && tar czf c6.tgz r && rm -rf r
