"""The first ``AdamW.step()`` over a sharded model's DTensor parameters, against the next ones
and against ``shardc.optim.local_shard_step`` (s46, issue 18; an analysis script, not a test).

From the checkout: ``PYTHONPATH=$PWD python docs/bench/compile_time/s46/cpu/first_optimizer_step.py
--blocks 64 [--local]``. One gloo rank on the CPU, the benchmarks' tiny 1b config with ``--blocks``
packed blocks, sharded (no compile: the step does not depend on it), AdamW (foreach) with zero
gradients; prints the parameter count and the seconds of three steps. Run each setting in its own
process: DTensor's sharding-propagation cache is per process.
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

_ROOT = os.getcwd()
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "benchmarks")]

p = argparse.ArgumentParser()
p.add_argument("--blocks", type=int, default=64)
p.add_argument("--local", action="store_true", help="shardc.optim.local_shard_step(optimizer)")
args = p.parse_args()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29631")
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)

import bench_mesh  # noqa: E402
import shardc  # noqa: E402
from train.shardc_mode import setup_shardc  # noqa: E402
from train.workload import build_model, model_config  # noqa: E402

cfg = model_config("1b", 32, True, args.blocks)
setup = setup_shardc(build_model(cfg, torch.device("cpu")),
                     bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=True,
                     inductor=False)
opt = torch.optim.AdamW(setup.params, lr=1e-4, foreach=True)
if args.local:
    shardc.optim.local_shard_step(opt)
params = opt.param_groups[0]["params"]
for param in params:
    param.grad = torch.zeros_like(param)
steps = []
for _ in range(3):
    start = time.perf_counter()
    opt.step()
    steps.append(time.perf_counter() - start)
print(f"torch {torch.__version__} blocks {args.blocks} params {len(params)} "
      f"local {args.local} steps " + " ".join(f"{s:.3f}" for s in steps))
dist.destroy_process_group()
