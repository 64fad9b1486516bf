"""One first training step of the benchmarks' tiny 1b config (width 64) at LAYERS blocks, world 1
over gloo, shardc's FX backend (``fx``) or Inductor (``ind``), packed or not; prints the phases
and torch's compile timers. s51's CPU measurements (with ``SHARDC_LOG=info`` for the stage
lines)::

    PYTHONPATH=$PWD python docs/bench/compile_time/s51/stage.py 64 fx packed
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29878"))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
from torch.distributed.device_mesh import init_device_mesh
from train.workload import build_model, model_config

import shardc

L = int(sys.argv[1]); inductor = sys.argv[2] == "ind"; pack = sys.argv[3] == "packed"
cfg = model_config("1b", 16, True, L, width=64)
model = build_model(cfg, torch.device("cpu"))
mesh = init_device_mesh("cpu", (1,))
mp = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
shardc.shard(model, mesh, mp_policy=mp, pack_blocks=pack)
def loss_fn(t, y):
    return torch.nn.functional.cross_entropy(model(t).flatten(0, 1).float(), y.flatten())
opts = dict(kv.split("=") for kv in os.environ.get("OPTS", "").split(",") if kv)
opts = {k: v == "1" for k, v in opts.items()}
fwd = torch.compile(loss_fn, backend=shardc.backend(inductor=inductor, **opts))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)
t = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
from torch._dynamo.utils import compile_times

t0 = time.perf_counter()
loss = fwd(t[:, :-1], t[:, 1:]); t1 = time.perf_counter(); loss.backward(); t2 = time.perf_counter(); opt.step(); opt.zero_grad()
t3 = time.perf_counter()
print(L, inductor, pack, f"fwd {t1-t0:.2f} bwd {t2-t1:.2f} opt {t3-t2:.2f} total {t3-t0:.2f}", float(loss))
print(compile_times(repr="str", aggregate=True))
dist.destroy_process_group()
