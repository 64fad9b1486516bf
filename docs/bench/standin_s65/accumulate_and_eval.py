"""Probe (not a test): the stack of loss_layouts.py under Inductor, two micro-batches accumulated
(``set_requires_gradient_sync(model, False)`` on the first), then an eval forward under
``no_grad``, against the unsharded model. Names: a loss of loss_layouts.LOSSES, ``ckpt_`` in front
for checkpointed blocks. ``PYTHONPATH=$PWD python docs/bench/standin_s65/accumulate_and_eval.py
mean ckpt_mean``"""
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, "docs/bench/standin_s65")
import loss_layouts as L
from torch.distributed.device_mesh import init_device_mesh

import shardc

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (1,))
for name in sys.argv[1:]:
    os.environ["CHECKPOINT"] = "1" if name.startswith("ckpt_") else "0"
    loss = L.LOSSES[name.replace("ckpt_", "")]
    torch.manual_seed(0)
    model = L.Stack(loss)
    ref = copy.deepcopy(model)
    shardc.shard(model, mesh)
    torch._dynamo.reset()
    c = torch.compile(model, backend=shardc.backend())
    try:
        xs = [torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(s)) for s in range(2)]
        shardc.set_requires_gradient_sync(model, False)
        c(xs[0]).backward()
        shardc.set_requires_gradient_sync(model, True)
        c(xs[1]).backward()
        for x in xs:
            ref(x).backward()
        R = dict(ref.named_parameters())
        gd = max((p.grad.full_tensor() - R[n].grad).abs().max().item()
                 for n, p in model.named_parameters())
        model.eval()
        ref.eval()
        with torch.no_grad():
            ev = abs(c(xs[0]).item() - ref(xs[0]).item())
        print(f"{name:22s} accumulated grad diff {gd:.2e} eval loss diff {ev:.2e}", flush=True)
    except Exception as e:
        print(f"{name:22s} FAILED {type(e).__name__}: {str(e)[-200:]}", flush=True)
