# s41 calls 2-4 (issue 18): the first step under a 5 ms stack sampler, one H200, torch 2.11,
# main 06cfeb7. The sampler was an untracked gpu_sample.py, committed afterwards as
# scripts/first_step_stacks.py (its record mode; call 2 kept flat counts only, call 3 whole
# stacks, call 4 whole stacks with each op call labelled). Call 3 ran
# `run shardc 8 cold; run fsdp2-compile 8 cold; run shardc 32 cold; run shardc 32 warm`,
# call 4 `run shardc 8 cold; run fsdp2-compile 8 cold; run shardc 8 warm`; kept here: call 3's
# 32-layer warm stacks, call 4's three.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R; C=/tmp/ctc; rm -rf $C
run() { # mode depth cache (warm reuses the cold run's cache directories)
 mkdir -p $C/$1_$2
 SAMPLE_OUT=$R/s_$1_$2_$3.json TORCHINDUCTOR_CACHE_DIR=$C/$1_$2/inductor \
   TRITON_CACHE_DIR=$C/$1_$2/triton SHARDC_LOG=info timeout 150 \
   python3 -m torch.distributed.run --standalone --nproc-per-node=1 scripts/first_step_stacks.py \
   --child --mode $1 --n-layers $2 --model 1b --result $R/res_$1_$2_$3.json --steps 2 \
   --timeout-s 140 > $R/log_$1_$2_$3.txt 2>&1; echo "$1 $2 $3 rc=$?"
}
run shardc 8 cold; run fsdp2-compile 8 cold; run shardc 8 warm
rm -rf $C
cd $OUT && tar czf c4.tgz r && rm -rf r
