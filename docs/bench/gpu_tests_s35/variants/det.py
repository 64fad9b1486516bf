"""s35 diagnostic: is the offloaded Inductor run deterministic? The test's _offloaded_run
(no overlap) twice and (overlap) twice; which parameters differ bitwise between them."""
import os, sys, tempfile
sys.path.insert(0, "tests/gpu"); sys.path.insert(0, "tests"); sys.path.insert(0, ".")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
import test_offload_gpu as t
torch.cuda.set_device(0)
dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
mesh = init_device_mesh("cuda", (1,))
names = [n for n, _ in t.Transformer(t.CFG).named_parameters()]
runs = {}
for label, overlap in (("plain_a", False), ("plain_b", False), ("over_a", True), ("over_b", True)):
    runs[label] = t._offloaded_run(mesh, "inductor", overlap)[0]
def diff(a, b):
    return [n for n, x, y in zip(names, runs[a], runs[b]) if not torch.equal(x, y)]
for a, b in (("plain_a", "plain_b"), ("over_a", "over_b"), ("plain_a", "over_a"), ("plain_b", "over_b")):
    print(a, "vs", b, "differ:", diff(a, b))
dist.destroy_process_group()
