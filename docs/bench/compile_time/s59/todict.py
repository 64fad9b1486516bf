import os, sys, tempfile, time, json, statistics, dataclasses
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
import torch, torch.distributed as dist
ROOT = os.getcwd(); sys.path[:0] = [ROOT, ROOT + "/benchmarks"]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1); torch.set_num_threads(1)
import bench_mesh
from train.runner import train_step
from train.shardc_mode import setup_shardc
from train.workload import build_model, model_config, synthetic_batches
from shardc.compile import warm
orig = warm.save_plan
def wrapped(plan, *a, **k):
    t_old, t_new = [], []
    for _ in range(5):
        t = time.process_time(); old = json.loads(json.dumps(dataclasses.asdict(plan), default=str)); t_old.append(time.process_time() - t)
        t = time.process_time(); new = plan.to_dict(); t_new.append(time.process_time() - t)
    old["predicted"], old["hash"] = plan.predicted.to_dict(), plan.hash()
    print("TODICT same:", old == new, "json same:", json.dumps(old) == json.dumps(new), "asdict-based", statistics.median(t_old), "to_dict", statistics.median(t_new), flush=True)
warm.save_plan = wrapped
n = int(sys.argv[1])
cfg = model_config("1b", 32, True, n)
data = synthetic_batches(1, 2, 32, cfg.vocab_size, 0, torch.device("cpu"))
setup = setup_shardc(build_model(cfg, torch.device("cpu")), bench_mesh.build_mesh("cpu", 1, None, 1), True, pack_blocks=True, inductor=False)
opt = torch.optim.AdamW(setup.params, lr=1e-4)
train_step(setup, opt, *data[0])
import shardc
for pl in shardc.explain_all(setup.keep[0]): wrapped(pl)
