"""First step (compile) and steady steps of the benchmarks' 1b config at world N on ONE device,
through torch's fake process group (collectives move no data): the compile of a world-N plan
without N devices. Usage (s53, one H200; env BATCH, STEPS, OPTS=k=1,... for shardc.backend)::

    PYTHONPATH=$PWD BATCH=1 python docs/bench/overhead/s53_h200/fake_w2.py cuda 2 32
    PYTHONPATH=$PWD python docs/bench/overhead/s53_h200/fake_w2.py cpu 2 2 tiny
"""
import json, os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))

from train.workload import build_model, model_config
import shardc
from torch.distributed.device_mesh import init_device_mesh
from torch._dynamo.utils import compile_times

dev, W, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tiny = "tiny" in sys.argv[4:]
opts = {k: v == "1" for k, v in (kv.split("=") for kv in os.environ.get("OPTS", "").split(",") if kv)}

import re
class MirrorStore(dist.Store):
    """A store for one process standing for every rank: a key set for one rank is set for all
    (shardc's rank-consistency checks read every rank's key)."""
    def __init__(self):
        super().__init__(); self.s = dist.HashStore()
    def _all(self, key):
        m = re.match(r"(.*/)(\d+)$", key)
        return [m.group(1) + str(r) for r in range(W)] if m else [key]
    def set(self, key, value):
        for k in self._all(key): self.s.set(k, value)
    def get(self, key): return self.s.get(key)
    def add(self, key, n): return self.s.add(key, n)
    def check(self, keys): return self.s.check(keys)
    def wait(self, keys, timeout=None): return None
    def delete_key(self, key): return self.s.delete_key(key)
    def num_keys(self): return self.s.num_keys()
    def compare_set(self, key, exp, des): return self.s.compare_set(key, exp, des)
STORE = MirrorStore()
dist.init_process_group("fake", rank=0, world_size=W, store=STORE)
cfg = model_config("1b", 16 if tiny else 2048, tiny, L, width=64 if tiny else None)
device = torch.device(dev)
model = build_model(cfg, device)
mesh = init_device_mesh(dev, (W,))
mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
shardc.shard(model, mesh, mp_policy=mp, pack_blocks=True)
def loss_fn(t, y):
    return torch.nn.functional.cross_entropy(model(t).flatten(0, 1).float(), y.flatten())
fwd = torch.compile(loss_fn, backend=shardc.backend(inductor=True, **opts))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
B, S = (2, 16) if tiny else (int(os.environ.get("BATCH", "1")), 2048)
g = torch.Generator().manual_seed(0)
t = torch.randint(0, cfg.vocab_size, (B, S + 1), generator=g).to(device)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
def step():
    loss = fwd(t[:, :-1], t[:, 1:]); loss.backward(); opt.step(); opt.zero_grad()
    return loss
t0 = time.perf_counter(); step(); sync(); first = time.perf_counter() - t0
for _ in range(3): step()
sync()
times, cpu = [], []
for _ in range(int(os.environ.get("STEPS", "10"))):
    a = time.perf_counter(); c = time.process_time(); step(); sync()
    times.append(time.perf_counter() - a); cpu.append(time.process_time() - c)
times.sort(); cpu.sort()
_n, _v = compile_times(repr="csv", aggregate=True); ct = {str(a): round(float(b), 3) for a, b in zip(_n, _v)}
keep = ["bytecode_tracing", "aot_trace_joint_graph", "ShardcPartitioner", "compile_fx.<locals>.fw_compiler_base",
        "compile_fx.<locals>.bw_compiler", "GraphLowering.run", "GraphLowering.codegen", "Scheduler.__init__"]
rec = dict(world=W, layers=L, opts=opts, first_step_s=round(first, 2), step_ms=round(1e3 * times[len(times)//2], 2),
           cpu_ms=round(1e3 * cpu[len(cpu)//2], 2), timers={k: ct.get(k) for k in keep})
print("RECORD", json.dumps(rec))
dist.destroy_process_group()
