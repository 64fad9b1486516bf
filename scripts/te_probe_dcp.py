"""Probe (GPU, TE): FP8-parameter TE models under shardc, where a value moves.
Run: PYTHONPATH=$PWD:/tmp/te-site:tests/gpu python3 scripts/te_probe_dcp.py"""
import tempfile

import te_fp8_common as common
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardc
from shardc.checkpoint import ModelState, OptimizerState

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0,
                        world_size=1)


def show(tag, model, before):
    now = common.values(model)
    moved = {n: (now[n] - before[n]).abs().max().item() for n in now}
    grads = {n: (None if p.grad is None else round(float(common.value(p.grad).norm()), 6))
             for n, p in model.named_parameters()}
    print(tag, "moved:", {k: f"{v:.2e}" for k, v in moved.items()})
    print(tag, "grads:", grads)
    return now


for sharded in (False, True):
    print("==== sharded" if sharded else "==== unsharded")
    recipe = shardc.te_fp8_recipe("current")
    model = common.build("TransformerLayer", bias=True, recipe=recipe)
    if sharded:
        shardc.shard(model)
    opt = common.optimizer(model)
    auto = common.shardc_autocast(model, recipe) if sharded else common.ref_autocast(recipe)
    v = common.values(model)
    for s in range(3):
        with auto():
            y = model(common.batch(s))
        y.float().pow(2).mean().backward()
        v_pre = common.values(model)
        print("grads before step", s, {n: (None if p.grad is None else
                                            round(float(common.value(p.grad).norm()), 6))
                                        for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        v = show(f"step {s}", model, v_pre)
    print("group", {k: val for k, val in opt.param_groups[0].items() if k != "params"})

# The DCP test's order.
recipe = shardc.te_fp8_recipe("current")
model = common.build("TransformerLayer", bias=True, recipe=recipe)
shardc.shard(model)
opt = common.optimizer(model)
for s in range(2):
    common.step(model, model, opt, common.shardc_autocast(model, recipe), common.batch(s))
saved = common.values(model)
path = tempfile.mkdtemp()
dcp.save({"model": ModelState(model), "optim": OptimizerState(model, opt)}, checkpoint_id=path)
with torch.no_grad(), shardc.te_autocast(model, recipe):
    model(common.batch(7))
common.step(model, model, opt, common.shardc_autocast(model, recipe), common.batch(2))
fresh = common.build("TransformerLayer", bias=True, seed=1, recipe=recipe)
shardc.shard(fresh)
fopt = common.optimizer(fresh)
f0 = common.values(fresh)
dcp.load({"model": ModelState(fresh), "optim": OptimizerState(fresh, fopt)}, checkpoint_id=path)
loaded = common.values(fresh)
sd = ModelState(common.build("TransformerLayer", bias=True, seed=3, recipe=recipe)).state_dict()
for n in saved:
    print(f"{n:50s} loaded-saved {(loaded[n]-saved[n]).abs().max().item():.3e} "
          f"fresh0-saved {(f0[n]-saved[n]).abs().max().item():.3e}")

# Delayed scaling: does unsharded TE compute its dgrad with a stale cached FP8 transpose after
# FusedAdam's FP8 update? Losses of: plain TE, TE with the transpose cache dropped after each
# step, shardc.
recipe = shardc.te_fp8_recipe("delayed")
runs = {}
for name in ("te", "te_fresh_transpose", "shardc"):
    model = common.build("LayerNormMLP", recipe=recipe)
    if name == "shardc":
        shardc.shard(model)
    opt = common.optimizer(model)
    auto = (common.shardc_autocast(model, recipe) if name == "shardc"
            else common.ref_autocast(recipe))
    losses = []
    for s in range(4):
        losses.append(common.step(model, model, opt, auto, common.batch(s)))
        if name == "te_fresh_transpose":
            for p in model.parameters():
                if hasattr(p, "_reset_caches"):
                    p._reset_caches()
    runs[name] = losses
print("delayed losses", runs)
