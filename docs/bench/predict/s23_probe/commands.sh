# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_3.sh (call 3, machine start B)
# s23 call 3 (machine start B; issues 19 and 22): calibrate over both ranks (profile format 9: the host-speed probe recorded), then default shardc at world 2 planned and predicted with the host terms rescaled to this run's probe (--refine-host; on the calibration's own start, a factor near 1): 1b 8L batch 1, 2, 4 and FP8 batch 4; then the optimizer-offload budget test's run with the CUDA allocator's history recorded (what is live at the measured peak)
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 230 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s23.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; grep -i "probe" $R/calibrate.log | head -2; tail -1 $R/calibrate.log
P=$R/2xh200_s23.json
echo "== predict refined $(date +%T)"
timeout 250 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --refine-host --configs 1b:8:1,1b:8:2,1b:8:4,1b:8:4:fp8 --blocks-once --steps 10 --deadline-s 235 --out $R --name predict_B > $R/predict_B.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "host probe" $R/predict_B.log | head -1; grep -E "^\| fsdp 2" $R/predict_B.md | head -4 | cut -c1-200
echo "== snapshot $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 gpu_snap.py $R > $R/snap.log 2>&1; echo "rc=$? $(date +%T)"; tail -2 $R/snap.log | cut -c1-300
cd $OUT && tar czf c3.tgz r && rm -rf r
