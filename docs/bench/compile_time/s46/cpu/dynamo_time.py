"""Throwaway: Dynamo's time (torch's timers) for the benchmarks' tiny llama at N blocks, FX
backend, world 1, packed; optional cProfile of the first step to --prof."""
import os, sys, time, cProfile
import torch, torch.distributed as dist
ROOT = os.getcwd(); sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29613"))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
n = int(sys.argv[1]); pack = sys.argv[2] != "0"; prof = sys.argv[3] if len(sys.argv) > 3 else None
cfg = model_config("1b", 32, True, n)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=pack, inductor=False)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
p = cProfile.Profile() if prof else None
if p: p.enable()
t = time.perf_counter(); train_step(setup, opt, *data[0]); first = time.perf_counter() - t
if p: p.disable(); p.dump_stats(prof)
from torch._dynamo.utils import compile_times
names, values = compile_times(repr="csv", aggregate=True)
d = dict(zip(names, values))
print(f"torch {torch.__version__} blocks {n} first {first:.2f}", {k: round(float(d[k]), 2) for k in ("_compile.compile_inner", "bytecode_tracing", "build_guards", "OutputGraph.call_user_compiler", "ShardcPartitioner") if k in d})
dist.destroy_process_group()
