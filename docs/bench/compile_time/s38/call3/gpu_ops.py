# Host and device time per call of shardc's one-op-per-bucket copies on this GPU, for one
# block's bucket of the 1b config at world 2 (pool_pack's two layouts, unpack_into) and at
# world 1 (cast_into, if this package has it). Run once per package (PYTHONPATH) to compare.
import os, sys, time
sys.path.insert(0, os.environ.get("PKG", os.getcwd()))  # the package to time, before the script dir
import torch
import shardc.ops.pool as pool
print("shardc from", pool.__file__)

SHAPES = [(2048,), (2048, 2048), (2048, 2048), (2048, 2048), (2048, 2048), (2048,),
          (5632, 2048), (5632, 2048), (2048, 5632)]
world, dev = 2, "cuda"
rows = [-(-s[0] // world) for s in SHAPES]
rest = [int(torch.tensor(s[1:]).prod()) if len(s) > 1 else 1 for s in SHAPES]
n = sum(r * k for r, k in zip(rows, rest))
shards = [torch.randn(r, *s[1:], device=dev) for r, s in zip(rows, SHAPES)]
grads = [torch.randn(*s, device=dev, dtype=torch.bfloat16) for s in SHAPES]
send = torch.empty(n, device=dev, dtype=torch.bfloat16)
table = torch.empty(world, n, device=dev)
gathered = torch.randn(world * n, device=dev, dtype=torch.bfloat16)
offsets = [sum(r * k for r, k in zip(rows[:i], rest[:i])) for i in range(len(SHAPES))]
outs = [torch.empty(world * r * k, device=dev, dtype=torch.bfloat16) for r, k in zip(rows, rest)]
full = [torch.randn(*s, device=dev) for s in SHAPES]
bf = [torch.empty(*s, device=dev, dtype=torch.bfloat16) for s in SHAPES]
cases = {
    "pool_pack all-gather send (9 shards, fp32->bf16)":
        lambda: torch.ops.shardc.pool_pack.default(send, shards, rows, world, False),
    "pool_pack reduce-scatter send (9 grads, bf16->fp32, /2)":
        lambda: torch.ops.shardc.pool_pack.default(table, grads, rows, world, True, 2),
    "unpack_into (9 weights out of the gathered bucket)":
        lambda: torch.ops.shardc.unpack_into.default(gathered, world, offsets, outs),
}
if hasattr(pool, "cast_into"):
    cases["cast_into (world 1: 9 weights fp32->bf16)"] = lambda: torch.ops.shardc.cast_into.default(full, bf)
for name, fn in cases.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, ev = time.perf_counter(), [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - start) / 200
    ev[1].record(); torch.cuda.synchronize()
    print(f"{name:60s} host {host * 1e6:8.1f} us/call   device+host {ev[0].elapsed_time(ev[1]) / 200 * 1e3:8.1f} us/call")
