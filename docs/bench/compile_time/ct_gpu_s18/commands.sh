# gpu_c2.sh (second half; see docs/bench/predict/s18_2xh200/commands.sh for gpu_env.sh)
# s18 call 2: predict_step again with the exposed-communication changes (issue 19: the wait before the embedding gradient's cast, indexed accumulations priced by their rows, 'waited for' measured), then cold compile time of default shardc, plain-pool and fsdp2-compile at 8 and 32 layers on one GPU (issue 18)
source gpu_env.sh
R=$OUT/r; mkdir -p $R/traces
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/2xh200_s18_calibrated.json
echo "== predict ($P) $(date +%T)"
timeout 240 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:16:1,1b:16:4,wide:8:2 --blocks-once --cudagraphs --memory-budget auto \
  --steps 12 --deadline-s 210 --keep-traces $R/traces --out $R --name predict_cg2 > $R/predict_cg2.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| fsdp" $R/predict_cg2.md | head -3 | cut -c1-260
echo "== compile time $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 benchmarks/compile_time.py --nproc 1 --model 1b --depths 8 32 --modes fsdp2-compile shardc-plain-pool shardc --caches cold \
  --steps 3 --timeout-s 150 --out $R --name ct_s18 > $R/ct_s18.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\|" $R/ct_s18.md | head -12 | cut -c1-220
cd $OUT && tar czf c2.tgz r && rm -rf r
