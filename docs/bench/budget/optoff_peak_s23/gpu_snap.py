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
