"""s37: Dynamo's compile_times for one cold or warm first step (1b config, world 1, CUDA)."""
import os, sys, time
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import logging
import torch, torch.distributed as dist
logging.basicConfig(level=logging.WARNING)
logging.getLogger("shardc").setLevel(logging.INFO)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
dev = torch.device("cuda", 0)
cfg = model_config("1b", 2048, False, int(sys.argv[1]))
data = synthetic_batches(1, 4, 2048, cfg.vocab_size, 0, dev)
setup = setup_shardc(build_model(cfg, dev), bench_mesh.build_mesh("cuda", 1, None, 1), True)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
t = time.perf_counter(); train_step(setup, opt, *data[0]); torch.cuda.synchronize()
print(f"first step {time.perf_counter() - t:.1f} s", flush=True)
from torch._dynamo.utils import compile_times
print(compile_times(repr="str", aggregate=True))
dist.destroy_process_group()
