"""Cast throughput on one GPU: the 1b config's layer weights (8 layers), three ways."""
import torch, json, sys
dev = "cuda"
dim, hid, L = 2048, 5632, 8
shapes = []
for _ in range(L):
    shapes += [(dim, dim)] * 4 + [(hid, dim), (dim, hid), (hid, dim), (dim,), (dim,)]
def make(dt): return [torch.randn(s, device=dev).to(dt) for s in shapes]
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ts = []
    for _ in range(n):
        ev[0].record(); fn(); ev[1].record(); torch.cuda.synchronize(); ts.append(ev[0].elapsed_time(ev[1]))
    ts.sort(); return ts[len(ts)//2]
res = {}
nel = sum(torch.Size(s).numel() for s in shapes)
for src_dt, dst_dt in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
    src = make(src_dt); tag = f"{str(src_dt)[6:]}->{str(dst_dt)[6:]}"
    def alloc(): return [torch.empty_like(t, dtype=dst_dt) for t in src]
    # per bucket of 9 (one foreach per layer), as shardc's cast_into
    def foreach_bucket():
        for i in range(0, len(src), 9):
            outs = [torch.empty_like(t, dtype=dst_dt) for t in src[i:i+9]]
            torch._foreach_copy_(outs, src[i:i+9])
    def per_tensor():
        for t in src: t.to(dst_dt)
    casts = torch.compile(lambda ts: [t.to(dst_dt) for t in ts])
    def compiled_bucket():
        for i in range(0, len(src), 9): casts(src[i:i+9])
    flats = [torch.cat([t.reshape(-1) for t in src[i:i+9]]) for i in range(0, len(src), 9)]
    def flat_bucket():
        for f in flats: f.to(dst_dt)
    for name, fn in (("flat_per_bucket", flat_bucket), ("foreach_per_bucket", foreach_bucket), ("per_tensor_to", per_tensor), ("inductor_per_bucket", compiled_bucket)):
        ms = bench(fn); res[f"{tag} {name}"] = ms
        print(f"{tag:16s} {name:22s} {ms:7.3f} ms  {nel*(src_dt.itemsize+dst_dt.itemsize)/ms/1e9:6.2f} TB/s", flush=True)
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "castbench.json", "w"), indent=1)

# Overlap: one layer's backward-like matmuls (tokens 8192) on the main stream while one layer's
# weights are cast fp32 -> bf16 on a side stream (what a world-1 "gather" on its own lane would do).
T = 8192
a_ = torch.randn(T, dim, device=dev, dtype=torch.bfloat16)
h_ = torch.randn(T, hid, device=dev, dtype=torch.bfloat16)
wq = torch.randn(dim, dim, device=dev, dtype=torch.bfloat16)
w1 = torch.randn(hid, dim, device=dev, dtype=torch.bfloat16)
w2 = torch.randn(dim, hid, device=dev, dtype=torch.bfloat16)
def mms():
    for _ in range(4): a_ @ wq.t()
    a_ @ w1.t(); a_ @ w1.t(); h_ @ w2.t()
    for _ in range(4): a_.t() @ a_
    h_.t() @ a_; h_.t() @ a_; a_.t() @ h_
layer = [torch.randn(s, device=dev) for s in shapes[:9]]
outs = [torch.empty_like(t, dtype=torch.bfloat16) for t in layer]
def cast_layer(): torch._foreach_copy_(outs, layer)
side = torch.cuda.Stream()
def both_serial(): mms(); cast_layer()
def both_overlap():
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side): cast_layer()
    mms()
    torch.cuda.current_stream().wait_stream(side)
try:
    import triton, triton.language as tl
    @triton.jit
    def _cast_k(src, dst, n, BLOCK: tl.constexpr, PROGS: tl.constexpr):
        pid = tl.program_id(0)
        for start in range(pid * BLOCK, n, PROGS * BLOCK):
            offs = start + tl.arange(0, BLOCK); m = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=m).to(tl.bfloat16), mask=m)
    flat_src = torch.cat([t.reshape(-1) for t in layer]); flat_dst = torch.empty_like(flat_src, dtype=torch.bfloat16)
    def small_grid(progs):
        def f(): _cast_k[(progs,)](flat_src, flat_dst, flat_src.numel(), BLOCK=4096, PROGS=progs)
        return f
    def overlap_small(progs):
        k = small_grid(progs)
        def f():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side): k()
            mms()
            torch.cuda.current_stream().wait_stream(side)
        return f
    extra = [(f"cast_grid{p}", small_grid(p)) for p in (16, 32, 132)] + [(f"overlap_grid{p}", overlap_small(p)) for p in (16, 32)]
except Exception as exc:
    print("no triton kernel:", exc); extra = []
for name, fn in [("mms", mms), ("cast_layer_foreach", cast_layer), ("serial", both_serial), ("overlap_foreach", both_overlap)] + extra:
    ms = bench(fn); res[f"overlap {name}"] = ms; print(f"overlap {name:20s} {ms:7.3f} ms", flush=True)
json.dump(res, open(sys.argv[1] if len(sys.argv) > 1 else "castbench.json", "w"), indent=1)
