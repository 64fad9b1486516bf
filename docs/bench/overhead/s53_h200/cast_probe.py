"""Probe: the re-cast of 16 layers' fp32 weights to bf16, foreach (today) vs one flat copy per layer."""
import json, statistics, torch
D, F, L = 2048, 5632, 16
shapes = [(D, D)] * 4 + [(F, D), (F, D), (D, F)]
n = sum(a * b for a, b in shapes)
flat = [torch.randn(n, device="cuda") for _ in range(L)]
views = [[f[o:o + a * b].view(a, b) for (a, b), o in zip(shapes, [sum(x * y for x, y in shapes[:i]) for i in range(len(shapes))])] for f in flat]
def foreach():
    for l in range(L):
        outs = [torch.empty(v.shape, device="cuda", dtype=torch.bfloat16) for v in views[l]]
        torch._foreach_copy_(outs, views[l])
def flatcast():
    for l in range(L):
        out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        out.copy_(flat[l])
def percopy():
    for l in range(L):
        for v in views[l]:
            torch.empty(v.shape, device="cuda", dtype=torch.bfloat16).copy_(v)
def t(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return round(statistics.median(ts), 3)
r = {k: [t(f) for _ in range(3)] for k, f in [("foreach", foreach), ("flat", flatcast), ("per_tensor", percopy)]}
r["GB"] = L * n * 6 / 1e9
print(json.dumps(r))
