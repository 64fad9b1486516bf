# gpu_env.sh and the call header: docs/bench/overhead/s20_2xh200/commands.sh
# gpu_e.sh
# s20 call E (issue 19): calibrate on this machine start, then predict default shardc (no CUDA graphs, no budget) at world 2 with that profile: 1b 8L batch 1, 2 and 4
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== calibrate $(date +%T)"
timeout 120 torchrun --nproc-per-node 2 -m shardc calibrate --out $R/2xh200_s20.json > $R/calibrate.log 2>&1; echo "rc=$? $(date +%T)"; tail -2 $R/calibrate.log
echo "== predict $(date +%T)"
timeout 185 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $R/2xh200_s20.json --configs 1b:8:1,1b:8:2,1b:8:4 --blocks-once --steps 10 --deadline-s 170 --out $R --name predict_default > $R/predict_default.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "^\| 1b" $R/predict_default.md | cut -c1-220
cd $OUT && tar czf e.tgz r && rm -rf r
