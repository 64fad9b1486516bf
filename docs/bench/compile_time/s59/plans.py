"""plans.py N packed(0/1) ind(0/1) OUT: every region's plan.to_json() after the first step."""
import os, sys, tempfile
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
import torch, torch.distributed as dist
ROOT = os.getcwd(); sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1); torch.set_num_threads(1)
import bench_mesh, shardc
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
n, pack, ind, out = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4]
cfg = model_config("1b", 32, True, n)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=pack, inductor=ind)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
train_step(setup, opt, *data[0])
with open(out, "w") as f:
    for pl in shardc.explain_all(setup.keep[0]):
        f.write(pl.to_json() + "\n")
print("WROTE", out, os.path.getsize(out))
