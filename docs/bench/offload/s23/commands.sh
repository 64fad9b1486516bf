# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# gpu_1.sh (call 1, machine start A; main 9f8050e exactly)
# s23 call 1 (issues 22, 19/20): world-1 CPU-offload GPU tests on cast22's code (the offload copies' casts as shardc::offload_copy_cast, CPU-checked only until now); then FP8's reduce-scatter wait past small buckets against the default rule, interleaved in one process per rank (step_overhead --rounds 3), default mode and the fast (CUDA graphs) mode, 1b 8L batch 4 FP8 at world 2
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== offload gpu tests $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_offload_gpu.py > $R/test_offload_gpu.log 2>&1; echo "rc=$? $(date +%T)"; tail -3 $R/test_offload_gpu.log
for pair in "shardc shardc-rswait" "shardc-fast shardc-fast-rswait"; do
  n=fp8_$(echo $pair | cut -d' ' -f1)
  echo "== $n $(date +%T)"
  timeout 195 torchrun --nproc-per-node 2 benchmarks/step_overhead.py --model 1b --n-layers 8 --batch 4 --fp8 --modes $pair --rounds 3 --steps 12 --out $R --name $n > $R/$n.log 2>&1; echo "rc=$? $(date +%T)"
  grep -E "^\| " $R/$n.md | head -8 | cut -c1-220
done
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_2.sh (call 2, start A; main 9f8050e exactly)
# s23 call 2 (issue 22): the failing optimizer-offload budget test alone; then the wide config's CPU-offload points at world 1 on cast22's code (auto, 6.69e9, 6.2e9 B beside FSDP2 + CPUOffloadPolicy), 15 timed steps each, fused AdamW
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt
echo "== budget test alone $(date +%T)"
CUDA_VISIBLE_DEVICES=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu "tests/gpu/test_offload_gpu.py::test_peak_budget_below_the_optimizer_step_trains_with_the_state_on_the_host" > $R/test_budget_alone.log 2>&1; echo "rc=$? $(date +%T)"; grep -E "AssertionError:|passed|failed" $R/test_budget_alone.log | head -3
echo "== offload $(date +%T)"
CUDA_VISIBLE_DEVICES=0 timeout 440 python3 benchmarks/budget_sweep.py --nproc 1 --model wide --no-sweep --offload-budgets auto 6.69e9 6.2e9 --baselines fsdp2-compile-offload --run-timeout-s 140 --out $R/offload_wide_s23 -- --n-layers 8 --optim-impl fused --steps 15 > $R/offload_wide_s23.log 2>&1; echo "rc=$? $(date +%T)"
grep -E "^\| (shardc|fsdp2)" $R/offload_wide_s23/curve.md | cut -c1-220
tail -3 $R/offload_wide_s23.log | cut -c1-250
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_3.sh (call 3, start B; ran main 658cfc3's code: the device's .git named 9f8050e with predict_step.py and cost_model.md modified, the probe23 merge; see docs/bench/predict/s23_probe/commit.txt) and its gpu_snap.py
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
# --- gpu_snap.py
"""s23 one-off: the optimizer-offload budget test's run with the CUDA allocator's history recorded, to find what is live at the measured peak (1.987e9 B against a 1.871e9 B budget/prediction)."""
import os, pickle, sys, tempfile
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import test_offload_gpu as t
out = sys.argv[1]
init = tempfile.mktemp()
dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{init}", rank=0, world_size=1)
torch.cuda.set_device(0)
mesh = init_device_mesh("cuda", (1,))
free_losses, free_peak, free_plan = t._budget_run(mesh, None)
budget = 4 * int(free_plan.predicted.param_bytes)
torch.cuda.memory._record_memory_history(max_entries=200000)
losses, peak, plan = t._budget_run(mesh, budget)
torch.cuda.memory._dump_snapshot(f"{out}/snap.pickle")
torch.cuda.memory._record_memory_history(enabled=None)
with open(f"{out}/plan.json", "w") as f:
    f.write(plan.to_json() if hasattr(plan, "to_json") else str(plan))
print("free_peak", free_peak, "budget", budget, "peak", peak, "pred", plan.predicted.peak_bytes)
print("budget record", plan.budget)
dist.destroy_process_group()
