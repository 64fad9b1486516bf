"""How much a host optimizer step on a worker thread slows the thread beside it (CPU only).

``shardc.step_in_backward`` steps CPU offload's buckets on a worker thread while the main
thread drives the backward. This measures the main thread's progress (a Python loop of small
torch ops, standing in for a backward's launches) alone and beside a worker running torch's
default AdamW (per-tensor, ``foreach=False``: what host tensors get) over the same shards as
DTensors or as plain tensors, and the worker's step time alone and beside it. One process, world
1 over gloo; each case in its own process (``--case dtensor|plain``), since both share one
interpreter's GIL. docs/offload.md quotes its output:

    python benchmarks/worker_gil.py --case dtensor
    python benchmarks/worker_gil.py --case plain
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def _params(case: str, tensors: int, numel: int, mesh) -> list[torch.Tensor]:
    out = []
    for _ in range(tensors):
        data, grad = torch.zeros(numel), torch.full((numel,), 1e-3)
        if case == "dtensor":
            p = DTensor.from_local(data, mesh, [Shard(0)]).requires_grad_()
            p.grad = DTensor.from_local(grad, mesh, [Shard(0)])
        else:
            p = data.requires_grad_()
            p.grad = grad
        out.append(p)
    return out


def _loop_rate(stop, work: torch.Tensor) -> float:
    """Chunks of 200 small in-place adds per second until ``stop()``."""
    n, t0 = 0, time.perf_counter()
    while not stop():
        for _ in range(200):
            work.add_(1e-6)
        n += 1
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=("dtensor", "plain"), required=True)
    ap.add_argument("--tensors", type=int, default=75,
                    help="parameters (the 1b 8-layer model's count)")
    ap.add_argument("--numel", type=int, default=200_000, help="elements each")
    ap.add_argument("--steps", type=int, default=5, help="worker steps timed")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}",
                                rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        opt = torch.optim.AdamW(_params(args.case, args.tensors, args.numel, mesh), lr=1e-4,
                                foreach=False)
        opt.step()  # creates the moments
        work = torch.randn(64, 64)
        end = time.perf_counter() + 1.0
        alone = _loop_rate(lambda: time.perf_counter() > end, work)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            opt.step()
        step_alone = (time.perf_counter() - t0) / args.steps
        done, timed = threading.Event(), {}

        def worker() -> None:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            timed["step"] = (time.perf_counter() - t0) / args.steps
            done.set()

        thread = threading.Thread(target=worker)
        thread.start()
        beside = _loop_rate(done.is_set, work)
        thread.join()
        dist.destroy_process_group()
    print(f"{args.case} ({args.tensors} x {args.numel}, {args.threads} threads): main loop "
          f"{alone:.0f}/s alone, {beside:.0f}/s beside the worker "
          f"({beside / alone:.2f}x); worker step {step_alone * 1e3:.1f} ms alone, "
          f"{timed['step'] * 1e3:.1f} ms beside the loop ({timed['step'] / step_alone:.2f}x)")


if __name__ == "__main__":
    main()
