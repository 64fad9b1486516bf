"""torch's Transformer scenario of tests/real_models.py (two encoder and two decoder layers),
sharded at world 1 and compiled with shardc's FX backend: prints the whole run's seconds (three
training steps, the first compiles), the bodies and the stand-ins the region kept ([0]: the
region was compiled again without them). Run from the tree to measure:
``PYTHONPATH=$PWD python docs/bench/standin_s63/seq2seq_first_step.py``."""
import os, sys, time
sys.path[:0] = [os.getcwd() + "/tests", os.getcwd()]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29815")
os.environ.setdefault("SHARDC_LOG", "info")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import real_models as rm
ctx = rm.Ctx(0, 1, sharded=True)
t = time.perf_counter()
out = rm.sc_torch_transformer(ctx)
print("TOTAL", round(time.perf_counter() - t, 2), out["bodies"], out.get("stand_ins"))
dist.destroy_process_group()
