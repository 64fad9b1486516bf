# gpu_env.sh: docs/bench/predict/s21_default/commands.sh (lines 2-6)
# The thirty-fifth session, one nvidia-h200 start (torch 2.11). The device's tree was main 36d3f00 (commit.txt; 'before'),
# with gpu_after/shardc = branch sib35's shardc package (the worker on plain stand-ins; 'after') first on PYTHONPATH
# for the after rows (commit.txt: the two step_in_backward.py checksums). The script's __file__ check line failed
# (shardc.optim.step_in_backward is re-exported as a function); the checksums in commit.txt are what tells the trees apart.

# gpu_sib.sh
# sib35: shardc.step_in_backward's worker on plain stand-ins (after) against DTensor stand-ins
# (before, main), one H200 (torch 2.11), 1b 8 layers batch 4 x 2048, CPU offload of parameters,
# h200 preset, --probe-host-adamw; rows interleaved, each its own torchrun. "after" runs main's
# tree with gpu_after/shardc (the branch's package) first on PYTHONPATH.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt
nvidia-smi -L >> $R/commit.txt 2>&1
nproc >> $R/commit.txt; python3 -c 'import torch; print(torch.__version__, torch.get_num_threads())' >> $R/commit.txt 2>&1
(cd gpu_after && md5sum shardc/optim/step_in_backward.py) >> $R/commit.txt
md5sum shardc/optim/step_in_backward.py >> $R/commit.txt
COMMON="--profile h200 --configs 1b:8:4 --seq 2048 --steps 5 --warmup 2 --profile-steps 0 --probe-host-adamw --out $R"
run() {  # name code timeout_s extra-args...
  local name=$1 code=$2 limit=$3; shift 3
  local pp=$PWD; [ "$code" = after ] && pp=$PWD/gpu_after:$PWD
  echo "== $name ($code) $(date +%T)"
  PYTHONPATH=$pp timeout $limit torchrun --nproc-per-node 1 benchmarks/predict_step.py $COMMON --name $name "$@" \
    > $R/$name.log 2>&1
  echo "rc=$? $(date +%T)"
  PYTHONPATH=$pp python3 -c "import shardc.optim.step_in_backward as m; print(m.__file__)" 2>&1 | tail -1
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
      f"{ms('measured_step_s')} ms; fwd+bwd meas {ms('measured_fwd_bwd_s')}; optimizer pred "
      f"{ms('predicted_optimizer_s')} / probed {ms('predicted_optimizer_probed_adamw_s')} / meas "
      f"{ms('measured_optimizer_s')}; host AdamW probed {p.get('probed_params_per_s', 0) / 1e9:.3f} G/s; "
      f"compile {r.get('compile_s', 0):.0f} s; sib {r.get('step_in_backward_counts')}")
PY
}
run sib_before_1 before 110 --offload params --step-in-backward
run sib_after_1 after 110 --offload params --step-in-backward
run params_1 before 110 --offload params
run sib_after_2 after 110 --offload params --step-in-backward
run sib_before_2 before 110 --offload params --step-in-backward
cd $OUT && tar czf sib.tgz r && rm -rf r
