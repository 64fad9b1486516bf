"""s36 diagnostic: is the offloaded Inductor run (tests/gpu/test_offload_gpu.py::_offloaded_run)
bitwise reproducible, with and without torch.use_deterministic_algorithms? Runs plain (no
overlap) and overlapped trainings alternately; prints which parameters differ from the first
plain run."""
import argparse, os, sys, tempfile
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests"); sys.path.insert(0, ".")
ap = argparse.ArgumentParser(); ap.add_argument("--det", action="store_true"); ap.add_argument("--pairs", type=int, default=3)
args = ap.parse_args()
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import test_offload_gpu as t
if args.det:
    torch.use_deterministic_algorithms(True, warn_only=True)
print("deterministic:", torch.are_deterministic_algorithms_enabled(), flush=True)
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
names = [n for n, _ in t.Transformer(t.CFG).named_parameters()]
ref = None
for i in range(args.pairs):
    for label, overlap in (("plain", False), ("over", True)):
        run = t._offloaded_run(mesh, "inductor", overlap)[0]
        if ref is None:
            ref = run; print(f"{label}_{i}: reference", flush=True); continue
        d = [n for n, x, y in zip(names, ref, run) if not torch.equal(x, y)]
        m = max((float((x - y).abs().max()) for x, y in zip(ref, run)), default=0.0)
        print(f"{label}_{i} vs plain_0 differ: {len(d)} params, max abs {m:.3g} {d[:4]}", flush=True)
dist.destroy_process_group()
