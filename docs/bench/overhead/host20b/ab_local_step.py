"""optimizer.step() CPU time, interleaved in one process: torch's AdamW (foreach) over the DTensor
parameters, with main's local_shard_step, with the branch's; and over plain tensors (the bound).
16-layer tiny llama (147 parameters), world 1 (gloo; the step is per shard, no communication)."""
import importlib.util, os, sys, time, statistics
sys.path[:0] = ["/work/wt-host20b", "/work/wt-host20b/benchmarks"]
import torch, torch.distributed as dist
from train.workload import build_model, model_config
import shardc
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29657")
dist.init_process_group("gloo")
torch.set_num_threads(1)
def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); return mod
main_ls = load("/work/wt-host20b-base/shardc/optim/local_step.py", "main_local_step")
branch_ls = load("/work/wt-host20b/shardc/optim/local_step.py", "branch_local_step")
cfg = model_config("1b", 16, True, 16, 32)
runs = {}
for name in ("dtensor", "local-main", "local-branch", "plain tensors"):
    model = build_model(cfg, torch.device("cpu"))
    if name != "plain tensors":
        shardc.shard(model)
    params = list(model.parameters())
    torch.manual_seed(1)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if name == "local-main":
        opt._shardc_local_step = main_ls.LocalShardStep(opt)
    elif name == "local-branch":
        opt._shardc_local_step = branch_ls.LocalShardStep(opt)
    runs[name] = (opt, params)
times = {n: [] for n in runs}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
    for n, (opt, _) in runs.items():
        t = time.thread_time(); opt.step(); times[n].append((time.thread_time() - t) * 1e3)
for n, ts in times.items():
    print(f"{n:14s} optimizer.step median {statistics.median(ts[10:]):.3f} ms CPU")
# the three DTensor runs stepped the same values: bitwise equal
ref = [p.to_local() for p in runs["dtensor"][1]]
for n in ("local-main", "local-branch"):
    assert all(torch.equal(a, b.to_local()) for a, b in zip(ref, runs[n][1])), n
print("dtensor, local-main and local-branch parameters bitwise equal")
dist.destroy_process_group()
