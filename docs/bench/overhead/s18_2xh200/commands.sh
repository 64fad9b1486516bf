# gpu_env.sh: as in docs/bench/predict/s18_2xh200/commands.sh

# gpu_c4.sh
# s18 call 4 (issue 20): world-1 step overhead with the sunk residual (sink_block_residual) beside compile-once, inline and the bound; interleaved rounds on GPU 0 (8 and 16 layers), each mode alone on GPU 1 (32 layers)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active --format=csv -l 2 > $R/clocks.csv 2>&1 &
SMI=$!
so() { # gpu port name rounds layers modes...
  local g=$1 p=$2 n=$3 r=$4 l=$5; shift 5
  CUDA_VISIBLE_DEVICES=$g timeout 470 torchrun --nproc-per-node 1 --master-port $p benchmarks/step_overhead.py --model 1b --n-layers $l \
    --modes "$@" --rounds $r --steps 10 --warmup 3 --out $R --name $n > $R/$n.log 2>&1
  echo "$n rc=$? $(date +%T)"
}
echo "start $(date +%T)"
( so 0 29511 w1_8_rounds 4 8 bound shardc-fast-budget shardc-fast-budget-sink shardc-fast-budget-inline;
  so 0 29513 w1_16_rounds 4 16 bound shardc-fast-budget shardc-fast-budget-sink ) & A=$!
so 1 29512 w1_32 1 32 bound shardc-fast-budget-sink shardc-fast-budget shardc-fast-budget-inline & B=$!
wait $A $B
kill $SMI
echo "== adamw probe $(date +%T)"; CUDA_VISIBLE_DEVICES=0 timeout 60 python3 gpu_adamw_probe.py docs/bench/predict/2xh200_s18_calibrated.json > $R/adamw_probe.log 2>&1; echo "rc=$?"; cat $R/adamw_probe.log | tail -6
grep -E "^\| 1b \| (8|16|32) \| 4 \| " $R/*.md | cut -c1-200
cd $OUT && tar czf c4.tgz r && rm -rf r

# gpu_adamw_probe.py (run by gpu_c4.sh)
# s18: device AdamW (foreach) time for the calibration's tensors (64 x 4M) and for a 1b-like mix of shards, each measured over shardc's optimizer model
import json, sys, torch
from shardc.planning.profile import load_profile
from shardc.planning.estimate import optimizer_step_seconds
from shardc.tools.calibrate import Timer, ADAMW_LEAD_CALLS
prof = load_profile(sys.argv[1]) if len(sys.argv) > 1 else None
dev = torch.device("cuda")
timer = Timer(dev)
L = 16
mixes = {
    "calib_64x4M": [4 << 20] * 64,
    "1b_16L_half": [32000 * 2048 // 2] * 2 + [2048 // 2] * (2 * L + 1) + ([2048 * 2048 // 2] * 4 + [2048 * 5632 // 2] * 3) * L,
    "1b_16L_layers_only": ([2048 * 2048 // 2] * 4 + [2048 * 5632 // 2] * 3) * L,
    "embed_only_2x32.8M": [32000 * 2048 // 2] * 2,
    "128x4M": [4 << 20] * 128,
}
out = {}
for name, sizes in mixes.items():
    params = [torch.zeros(n, device=dev, requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    opt.step()
    s = timer.median(opt.step, reps=5, warmup=1, lead_calls=ADAMW_LEAD_CALLS)
    m = optimizer_step_seconds(4.0 * sum(sizes), len(sizes), prof, ran="foreach") / prof.device_optimizer_scale("foreach") if prof else float("nan")
    out[name] = {"tensors": len(sizes), "elements": sum(sizes), "ms": s * 1e3, "model_unscaled_ms": m * 1e3, "ratio": s / m}
    print(name, json.dumps(out[name]), flush=True)
    del opt, params
    torch.cuda.empty_cache()

# gpu_c5.sh (reverse/)
# s18 call 5 (issue 20): a second 32-layer sample, the modes in the reverse order (GPU 0), and 16 layers with the blocks inline beside the sunk residual (GPU 1, 2 rounds)
source gpu_env.sh
R=$OUT/r; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt
so() { # gpu port name rounds layers modes...
  local g=$1 p=$2 n=$3 r=$4 l=$5; shift 5
  CUDA_VISIBLE_DEVICES=$g timeout 255 torchrun --nproc-per-node 1 --master-port $p benchmarks/step_overhead.py --model 1b --n-layers $l \
    --modes "$@" --rounds $r --steps 10 --warmup 3 --out $R --name $n > $R/$n.log 2>&1
  echo "$n rc=$? $(date +%T)"
}
echo "start $(date +%T)"
so 0 29511 w1_32_rev 1 32 shardc-fast-budget shardc-fast-budget-sink bound & A=$!
so 1 29512 w1_16_inline 2 16 bound shardc-fast-budget-sink shardc-fast-budget-inline & B=$!
wait $A $B
grep -E "^\| 1b \| (16|32) \| 4 \| [a-z-]+ \| [0-9.]+ \| " $R/*.md | cut -c1-120
cd $OUT && tar czf c5.tgz r && rm -rf r
