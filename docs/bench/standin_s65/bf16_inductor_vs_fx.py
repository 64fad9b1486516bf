"""Probe (not a test): the stack of loss_layouts.py with a bf16 gather policy
(``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, the input cast
to bf16 by the caller: shardc does not cast forward inputs), one step under Inductor and under FX:
the largest gradient difference between the two. Names as in accumulate_and_eval.py."""
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
def run(name, inductor):
    os.environ["CHECKPOINT"] = "1" if name.startswith("ckpt_") else "0"
    torch.manual_seed(0)
    model = L.Stack(L.LOSSES[name.replace("ckpt_", "")])
    policy = shardc.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shardc.shard(model, mesh, mp_policy=policy)
    torch._dynamo.reset()
    c = torch.compile(model, backend=shardc.backend(inductor=inductor))
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(0))
    c(x.to(torch.bfloat16)).float().backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}
for name in sys.argv[1:]:
    try:
        a, b = run(name, False), run(name, True)
        scale = max(v.abs().max().item() for v in a.values())
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        print(f"{name:20s} inductor vs fx (bf16): max grad diff {diff:.2e} "
              f"(grad scale {scale:.2e})", flush=True)
    except Exception as e:
        print(f"{name:20s} FAILED {type(e).__name__}: {str(e)[-200:]}", flush=True)
