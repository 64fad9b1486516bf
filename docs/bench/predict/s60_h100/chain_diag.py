"""s60 diagnostic (issue 19): the compiled chains' host cost timed as before s60 (each chain once,
right after its own compile) and as now (both compiled first, interleaved rounds), in one process."""
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from shardc.tools import calibrate as cal

dev = torch.device("cuda")
t0 = time.perf_counter()
torch.ones(1, device=dev)
sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
points, fns, kernels = [], [], []
for length in (4, 32):
    weight = torch.randn(64, 64, device=dev, requires_grad=True)
    x = torch.randn(64, 64, device=dev)

    def chain(inp, w=weight, n=length):
        for _ in range(n):
            inp = torch.relu(inp @ w)
        return inp

    compiled = torch.compile(chain)

    def step(fn=compiled, inp=x):
        fn(inp).sum().backward()

    for _ in range(3):
        step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    k = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    start = time.perf_counter()
    for _ in range(50):
        step()
    sync()
    points.append((k, (time.perf_counter() - start) / 50))
    fns.append(step)
    kernels.append(k)
old = cal.fit_compiled_host_cost(*points)
t_old = time.perf_counter() - t0
rounds = cal.interleaved_rounds(fns, cal.COMPILED_ROUNDS, cal.COMPILED_STEPS, sync)
new = cal.fit_compiled_host_rounds(tuple(kernels), rounds)
late = []
for k, fn in zip(kernels, fns):
    sync()
    start = time.perf_counter()
    for _ in range(50):
        fn()
    sync()
    late.append((k, (time.perf_counter() - start) / 50))
old_late = cal.fit_compiled_host_cost(*late)
print(json.dumps({"tag": sys.argv[1] if len(sys.argv) > 1 else "", "kernels": kernels,
                  "old_first": {"per_kernel_us": old[0] * 1e6, "per_call_us": old[1] * 1e6,
                                "step_ms": [p[1] * 1e3 for p in points], "at_s": t_old},
                  "new_rounds": {"per_kernel_us": new.per_kernel_s * 1e6,
                                 "per_call_us": new.per_call_s * 1e6,
                                 "spread_us": {k: [v * 1e6 for v in lh] for k, lh in new.spread.items()},
                                 "rounds_ms": [[v * 1e3 for v in r] for r in rounds]},
                  "old_style_again": {"per_kernel_us": old_late[0] * 1e6,
                                      "per_call_us": old_late[1] * 1e6,
                                      "step_ms": [p[1] * 1e3 for p in late]}}))
