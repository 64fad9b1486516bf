"""Count Dynamo's traced bytecode steps by function, N blocks packed/not, world 1 FX (probe)."""
import os, sys, collections
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29877")
import torch, torch.distributed as dist
from torch._dynamo import symbolic_convert as sc
counts = collections.Counter()
real = sc.InstructionTranslatorBase.step
def step(self):
    c = self.f_code
    counts[(os.path.relpath(c.co_filename, "/work/main") if "/work/main" in c.co_filename else c.co_filename.split("site-packages/")[-1], c.co_name)] += 1
    return real(self)
sc.InstructionTranslatorBase.step = step
ROOT = os.getcwd(); sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
dist.init_process_group("gloo", rank=0, world_size=1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
n, pack = int(sys.argv[1]), sys.argv[2] == "1"
cfg = model_config("1b", 32, True, n)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=pack, inductor=False)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
train_step(setup, opt, *data[0])
import json
json.dump({f"{k[0]}::{k[1]}": v for k, v in counts.items()}, open(f"/tmp/dyn_{n}_{int(pack)}.json", "w"))
print("total", sum(counts.values()))
