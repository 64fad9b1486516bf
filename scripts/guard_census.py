"""Compile one training step of a small sharded Llama (4 blocks by default, ``--n-layers``; one
rank over gloo, CPU) with shardc's backend (``--mode plain``: with plain inputs; ``--mode
packed``: blocks packed; ``--mode bound``: unsharded, Inductor) and count the guards Dynamo
installs for it, by kind, then time their check (issue 20: the per-step guard evaluation).
docs/overhead.md, "Guards per step", quotes both.

    PYTHONPATH=$PWD python scripts/guard_census.py
    TORCH_LOGS=guards PYTHONPATH=$PWD python scripts/guard_census.py 2> guards.log

The second form also writes Dynamo's guard tree (each guard with the traced line that installed
it) to guards.log. The time is that of the cache entry's guard check on the step's locals,
median over repeats of ``--calls`` calls: the host cost of each step's cache lookup.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardc
from shardc import _torch
from shardc.models.llama import LlamaConfig, Transformer, llama_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="guard checks per repeat")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--mode", choices=("shardc", "plain", "packed", "bound"),
                        default="shardc",
                        help="shardc (default options); plain: shardc.shard(..., "
                             "plain_inputs=True); packed: shardc.shard(..., pack_blocks=True); "
                             "bound: the unsharded model, parameters read "
                             "as bf16 (benchmarks/train/baselines.py), Inductor")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = Transformer(LlamaConfig(dim=64, n_layers=args.n_layers, n_heads=4,
                                        vocab_size=128, max_seq_len=32))
        if args.mode == "bound":
            _swap_param_reads(model, lambda p: p.to(torch.bfloat16))
        else:
            shardc.shard(model, mesh, plain_inputs=args.mode == "plain",
                         pack_blocks=args.mode == "packed")

        def fn(t, y):
            return llama_loss(model(t), y)

        step = torch.compile(fn, backend="inductor" if args.mode == "bound" else "shardc")
        tokens, targets = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
        step(tokens, targets).backward()
        guards = _torch.cached_guards(fn.__code__)
        kinds = collections.Counter(kind for kind, _ in guards)
        print(f"{len(guards)} guards: " + ", ".join(f"{n} {k}" for k, n in kinds.most_common()))
        check, frame = _torch.cached_guard_check(fn.__code__), {"t": tokens, "y": targets,
                                                                 "model": model}
        assert check(frame), "the guards fail on the step's own locals"
        per_call = []
        for _ in range(args.repeats):
            start = time.thread_time_ns()
            for _ in range(args.calls):
                check(frame)
            per_call.append((time.thread_time_ns() - start) / args.calls / 1e3)
        print(f"guard check: median {statistics.median(per_call):.1f} us per call, "
              f"min {min(per_call):.1f} ({args.repeats} x {args.calls} calls, thread CPU time)")
    finally:
        dist.destroy_process_group()


def _swap_param_reads(module, read) -> None:
    """The bound's parameter reads (benchmarks/train/setup.py ``swap_param_reads``)."""
    for sub in module.modules():
        names = [n for n, p in sub._parameters.items() if p is not None]
        if names:
            props = {n: property(lambda self, n=n: read(self._parameters[n])) for n in names}
            sub.__class__ = type(f"Bound{type(sub).__name__}", (type(sub),), props)


if __name__ == "__main__":
    main()
