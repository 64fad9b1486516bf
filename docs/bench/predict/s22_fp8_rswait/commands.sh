# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_4.sh (call 4; ran main 1c4c57e's code: the device's .git named e914d41, and its diff hash equals git diff e914d41 1c4c57e over the modified files)
# s22 call 4 (issues 19 and 20): FP8's reduce-scatter wait passing over the small norm buckets (ShardcOptions.reduce_scatter_wait_past_small_buckets) against the default rule, 1b 8L batch 4 FP8 at world 2: under CUDA graphs (where the stall is real) and in default mode; each a predict_step run (predicted and measured, waited communication), one after the other on this start; profile: the twenty-first session's two-GPU calibration
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
P=docs/bench/predict/s21_default/2xh200_s21.json
OPT="--backend-option reduce_scatter_wait_past_small_buckets=true"
run() {  # name, timeout, extra args
  echo "== $1 $(date +%T)"
  timeout $2 torchrun --nproc-per-node 2 benchmarks/predict_step.py --profile $P --configs 1b:8:4:fp8 --blocks-once --steps 12 --out $R --name $1 "${@:3}" > $R/$1.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| fsdp 2 \| 1b \| 8 \| 4 x 2048 \| fp8" $R/$1.md | head -1 | cut -c1-220
}
run fp8_cg_default 125 --cudagraphs --memory-budget auto
run fp8_cg_rswait 125 --cudagraphs --memory-budget auto $OPT
run fp8_rswait 110 $OPT
run fp8_default 110
cd $OUT && tar czf c4.tgz r && rm -rf r
