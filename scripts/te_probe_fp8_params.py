"""Probe (GPU, TE): under delayed scaling, does unsharded TE with ``FusedAdam`` compute its input
gradients with a stale cached FP8 transpose after the optimizer rewrites an FP8 parameter?

Prints the losses of 4 steps of an FP8-parameter ``LayerNormMLP`` three ways: plain TE, TE with
its cached transposes dropped after each step, and shardc (which builds each gathered weight's
transpose from the current bytes). docs/fp8.md quotes the result.
Run: PYTHONPATH=$PWD:/tmp/te-site:tests/gpu python3 scripts/te_probe_fp8_params.py"""
import tempfile

import te_fp8_common as common
import torch
import torch.distributed as dist

import shardc

torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0,
                        world_size=1)
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
            common.drop_stale_transposes(model)
    runs[name] = losses
print("delayed losses", runs)
