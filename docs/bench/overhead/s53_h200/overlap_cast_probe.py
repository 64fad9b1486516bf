"""Probe: does a fp32->bf16 weight cast on a side stream hide under a layer's backward matmuls?"""
import json, statistics, sys, torch
torch.manual_seed(0)
dev = "cuda"
D, F, T, L = 2048, 5632, 8192, 16
shapes = [(D, D)] * 4 + [(F, D), (F, D), (D, F)]
masters = [[torch.randn(s, device=dev) for s in shapes] for _ in range(L)]
x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
xf = torch.randn(T, F, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()

def layer_bwd(ws):
    out = 0
    for w in ws:
        gi = x if w.shape[0] == D else xf  # grad out [T, out]
        inp = xf if w.shape[1] == F else x  # input [T, in]
        dx = gi @ w            # [T, in]
        dw = gi.t() @ inp      # [out, in]
    return dx, dw

def cast(ws):
    outs = [torch.empty(w.shape, device=dev, dtype=torch.bfloat16) for w in ws]
    torch._foreach_copy_(outs, ws)
    return outs

def serial():
    for l in reversed(range(L)):
        ws = cast(masters[l])
        layer_bwd(ws)

def overlapped():
    cur = torch.cuda.current_stream()
    pending = {}
    def issue(l):
        outs = [torch.empty(w.shape, device=dev, dtype=torch.bfloat16) for w in masters[l]]
        ev = torch.cuda.Event(); ev.record(cur)
        side.wait_event(ev)
        with torch.cuda.stream(side):
            torch._foreach_copy_(outs, masters[l])
        done = torch.cuda.Event(); done.record(side)
        pending[l] = (outs, done)
    issue(L - 1)
    for l in reversed(range(L)):
        if l > 0:
            issue(l - 1)
        outs, done = pending.pop(l)
        cur.wait_event(done)
        layer_bwd(outs)

def cast_only():
    for l in reversed(range(L)):
        cast(masters[l])

def bwd_only():
    ws = cast(masters[0])
    for l in reversed(range(L)):
        layer_bwd(ws)

def timeit(fn, reps=30):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)

def graphed(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    return g.replay

res = {}
for rnd in range(3):
    for name, fn in [("bwd_only", bwd_only), ("cast_only", cast_only), ("serial", serial), ("overlapped", overlapped)]:
        res.setdefault(name, []).append(timeit(fn))
for name, fn in [("serial_graph", serial), ("overlapped_graph", overlapped), ("bwd_only_graph", bwd_only)]:
    g = graphed(fn)
    res[name] = [timeit(g) for _ in range(3)]
# correctness: overlapped casts equal serial casts
out = {k: [round(v, 3) for v in vs] for k, vs in res.items()}
print(json.dumps(out, indent=1))
