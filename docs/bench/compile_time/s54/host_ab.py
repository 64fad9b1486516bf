"""World 1, gloo, Inductor, tiny 1b config (width 32, seq 16) at L layers: steady step wall time,
pack_blocks True vs False (plain reads both), and the bound; models built once, steps interleaved."""
import os, sys, time, statistics
import torch, torch.distributed as dist
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "benchmarks"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29883")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from train.workload import build_model, model_config
import shardc
L = int(sys.argv[1])
cfg = model_config("1b", 16, True, L, width=32)
mesh = init_device_mesh("cpu", (1,))
mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
def make(pack):
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    if pack is not None:
        shardc.shard(model, mesh, mp_policy=mp, pack_blocks=pack)
        be = shardc.backend()
    else:
        be = "inductor"
    def loss_fn(t, y):
        return torch.nn.functional.cross_entropy(model(t).flatten(0, 1).float(), y.flatten())
    fwd = torch.compile(loss_fn, backend=be)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return fwd, opt
g = torch.Generator().manual_seed(0)
t = torch.randint(0, cfg.vocab_size, (1, 17), generator=g)
runs = {"packed": make(True), "perparam": make(False)}
def step(fwd, opt):
    loss = fwd(t[:, :-1], t[:, 1:]); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for name, (fwd, opt) in runs.items():
    for _ in range(3): step(fwd, opt)
times = {k: [] for k in runs}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 15):
    for name, (fwd, opt) in runs.items():
        t0 = time.perf_counter()
        for _ in range(5): step(fwd, opt)
        times[name].append((time.perf_counter() - t0) / 5 * 1e3)
for k, v in times.items():
    print(k, "median %.2f ms  min %.2f" % (statistics.median(v), min(v)))
print("packed/perparam medians %.3f" % (statistics.median(times["packed"]) / statistics.median(times["perparam"])))
