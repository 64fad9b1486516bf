"""Probe (GPU, TE): where a DCP round trip of an FP8-parameter TE model loses a value.
Run: PYTHONPATH=$PWD:/tmp/te-site:tests/gpu python3 scripts/te_probe_dcp.py <dir>"""
import sys
import tempfile

import te_fp8_common as common
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardc
from shardc.checkpoint import ModelState, OptimizerState

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
recipe = shardc.te_fp8_recipe("current")
model = common.build("TransformerLayer", bias=True, recipe=recipe)
shardc.shard(model)
opt = common.optimizer(model)
for s in range(2):
    common.step(model, model, opt, common.shardc_autocast(model, recipe), common.batch(s))
print("saved group step", [g.get("step") for g in opt.param_groups])
saved = common.values(model)
dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)}, checkpoint_id=path)
after_save = common.values(model)
print("values changed by save:", [n for n in saved if not torch.equal(saved[n], after_save[n])])
fresh = common.build("TransformerLayer", bias=True, seed=1, recipe=recipe)
shardc.shard(fresh)
fopt = common.optimizer(fresh)
v0 = common.values(fresh)
osd = OptimizerState(fresh, fopt).state_dict()
v1 = common.values(fresh)
print("values changed by optimizer init:", [n for n in v0 if not torch.equal(v0[n], v1[n])])
print("fresh group step after init", [g.get("step") for g in fopt.param_groups])
msd = ModelState(fresh).state_dict()
dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fopt)}, checkpoint_id=path)
loaded = common.values(fresh)
print("fresh group step after load", [g.get("step") for g in fopt.param_groups])
for n in saved:
    d = (loaded[n] - saved[n]).abs().max().item()
    d0 = (v0[n] - saved[n]).abs().max().item()
    print(f"{n:55s} loaded-saved {d:.3e}  fresh-saved {d0:.3e}")
# Load the model part alone, straight from the files.
sd = ModelState(fresh).state_dict()
dcp.load({"model": sd}, checkpoint_id=path)
for n in ("self_attention.layernorm_qkv.layer_norm_weight", "self_attention.proj.weight"):
    v = sd[n]
    v = v.full_tensor() if hasattr(v, "full_tensor") else v
    print("file value", n, (v.float() - saved[n]).abs().max().item())
