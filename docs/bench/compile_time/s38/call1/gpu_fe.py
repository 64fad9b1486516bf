# Whether torch._foreach_copy_ casting fp32 -> bf16 (and bf16 -> fp32) is one kernel on this GPU.
import torch
from torch.profiler import profile, ProfilerActivity
srcs = [torch.randn(2048, 2048, device="cuda") for _ in range(7)] + [torch.randn(2048, device="cuda")] * 2
for a, b in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
    xs = [s.to(a) for s in srcs]
    outs = [torch.empty_like(s, dtype=b) for s in srcs]
    torch._foreach_copy_(outs, xs); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        torch._foreach_copy_(outs, xs); torch.cuda.synchronize()
    names = [e.name for e in p.events() if e.device_type.name == "CUDA"]
    print(a, "->", b, len(names), "kernels:", sorted(set(n[:90] for n in names)))
    assert all(torch.equal(o, x.to(b)) for o, x in zip(outs, xs))
