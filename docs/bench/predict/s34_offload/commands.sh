# gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6)
# The thirty-fourth session, two nvidia-h200 starts (one per call). The device's .git said 94bdd8c; the working tree was main 3392100 (call 1) and 8b1d83d's merge (call 2), see each call's commit.txt.

# gpu_offpred.sh (call 1)
# offpred: predict_step.py with CPU offload on one H200 (torch 2.11), 1b 8 layers batch 4 x 2048,
# h200 preset: (a) --offload params, (b) + --step-in-backward, (c) --offload optimizer,
# (d) no offload (reference). Each its own torchrun under timeout (~7.7 min at most in all).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt
nvidia-smi -L >> $R/commit.txt 2>&1
COMMON="--profile h200 --configs 1b:8:4 --seq 2048 --steps 5 --warmup 2 --profile-steps 0 --out $R"
run() {  # name timeout_s extra-args...
  local name=$1 limit=$2; shift 2
  echo "== $name $(date +%T)"
  timeout $limit torchrun --nproc-per-node 1 benchmarks/predict_step.py $COMMON --name $name "$@" \
    > $R/$name.log 2>&1
  echo "rc=$? $(date +%T)"
  grep -E "^\| fsdp" $R/$name.md 2>/dev/null | head -1 | cut -c1-230
  python3 - $R/$name.json <<'PY' 2>/dev/null || tail -3 $R/$name.log
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]
if r.get("status") != "ok":
    print(r.get("status"), r.get("reason", "")[:300]); sys.exit()
ms = lambda k: "-" if r.get(k) is None else f"{r[k] * 1e3:.1f}"
print(f"step pred {ms('predicted_step_s')} / meas {ms('measured_step_s')} ms; fwd+bwd "
      f"{ms('predicted_fwd_bwd_s')} / {ms('measured_fwd_bwd_s')}; optimizer "
      f"{ms('predicted_optimizer_s')} / {ms('measured_optimizer_s')}; host step "
      f"{ms('predicted_optimizer_host_s')}; compile {r.get('compile_s', 0):.0f} s; "
      f"sib {r.get('step_in_backward_counts')}")
PY
}
run offpred_params 120 --offload params
run offpred_params_sib 120 --offload params --step-in-backward
run offpred_optimizer 120 --offload optimizer
run offpred_none 100
cd $OUT && tar czf offpred.tgz r && rm -rf r

# gpu_adamprobe.sh (call 2)
# adamprobe: predict_step.py --probe-host-adamw with CPU offload on one H200 (torch 2.11), 1b 8
# layers batch 4 x 2048, h200 preset: (a) --offload params, (b) + --step-in-backward,
# (c) --offload optimizer. Each its own torchrun under timeout (6 min at most in all).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt
nvidia-smi -L >> $R/commit.txt 2>&1
nproc >> $R/commit.txt; python3 -c 'import torch; print(torch.__version__, torch.get_num_threads())' >> $R/commit.txt 2>&1
COMMON="--profile h200 --configs 1b:8:4 --seq 2048 --steps 5 --warmup 2 --profile-steps 0 --probe-host-adamw --out $R"
run() {  # name timeout_s extra-args...
  local name=$1 limit=$2; shift 2
  echo "== $name $(date +%T)"
  timeout $limit torchrun --nproc-per-node 1 benchmarks/predict_step.py $COMMON --name $name "$@" \
    > $R/$name.log 2>&1
  echo "rc=$? $(date +%T)"
  grep -m1 "host AdamW" $R/$name.log
  python3 - $R/$name.json <<'PY' 2>/dev/null || tail -3 $R/$name.log
import json, sys
d = json.load(open(sys.argv[1]))
r, p = d["results"][0], d["meta"].get("host_adamw_probe") or {}
if r.get("status") != "ok":
    print(r.get("status"), r.get("reason", "")[:300]); sys.exit()
ms = lambda k: "-" if r.get(k) is None else f"{r[k] * 1e3:.1f}"
err = lambda k: "-" if not r.get(k) else f"{(r[k] / r['measured_step_s'] - 1) * 100:+.1f}%"
print(f"step pred {ms('predicted_step_s')} ({err('predicted_step_s')}) / probed "
      f"{ms('predicted_step_probed_adamw_s')} ({err('predicted_step_probed_adamw_s')}) / meas "
      f"{ms('measured_step_s')} ms; optimizer pred {ms('predicted_optimizer_s')} / probed "
      f"{ms('predicted_optimizer_probed_adamw_s')} / meas {ms('measured_optimizer_s')}; host "
      f"AdamW {p.get('ran')} probed {p.get('probed_params_per_s', 0) / 1e9:.3f} vs profile "
      f"{p.get('profile_params_per_s', 0) / 1e9:.3f} G/s on {p.get('threads')} threads "
      f"(calibration's {p.get('calibration_threads')}), probe {p.get('probe_s', 0):.2f} s; "
      f"compile {r.get('compile_s', 0):.0f} s; sib {r.get('step_in_backward_counts')}")
PY
}
run adamprobe_params 120 --offload params
run adamprobe_params_sib 120 --offload params --step-in-backward
run adamprobe_optimizer 120 --offload optimizer
run adamprobe_params_again 110 --offload params
cd $OUT && tar czf adamprobe.tgz r && rm -rf r
