import time, os, subprocess
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from torch._inductor.async_compile import maybe_warm_pool, AsyncCompile
from torch._inductor.compile_worker.utils import *  # noqa
t2 = time.perf_counter()
maybe_warm_pool()
t3 = time.perf_counter()
while not AsyncCompile.use_process_pool():
    time.sleep(0.05)
t4 = time.perf_counter()
print(f"import torch {t1-t0:.2f} import async_compile {t2-t1:.2f} warm call {t3-t2:.2f} ready after {t4-t3:.2f}")
out = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid,rss,cmd"], capture_output=True, text=True).stdout
print(out[:500])
kids = [l.split()[0] for l in out.splitlines()[1:]]
for k in kids:
    print(subprocess.run(["ps", "--ppid", k, "-o", "pid,rss,cmd"], capture_output=True, text=True).stdout[:800])
