"""s75 repro (observation E): ranks whose inputs are views of differently shaped tensors
recompile differently under Dynamo's dynamic shapes, which shardc turns into PlanMismatchError.

Run: cd <worktree> && python docs/bench/probes_s75/repros/rank_view_recompile.py
Two gloo ranks (group timeout 15 s), FX backend. Each step every rank passes `x[0:4]`, a view:
steps 0 and 1 of a fresh 2-D tensor (lengths 5/4, then 4/3: both ranks recompile at step 1 with
the length dynamic); at step 2 rank 1's view is of a 3-D tensor (`batch[2]`, as
`tokens[step, rows]` is) and rank 0's of a fresh 2-D one. Dynamo's dynamic graph guards the
view's base (`x._base.stride()[0] == x._base.size()[1]`, TORCH_LOGS=recompiles), so rank 1
alone recompiles. Seen (torch 2.13, s75): both ranks raise shardc's PlanMismatchError
("ranks recompiled differently") after the timeout. Plain torch.compile: a harmless extra
recompile on rank 1 (PLAIN=1: the unsharded model through backend="aot_eager", same inputs:
completes; a shardc-sharded model under backend="eager" hits repro G instead).
"""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, t):
        h = self.embed(t)
        for b in self.blocks:
            h = h + b(h)
        return h


def worker(rank, world, init, plain):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=15))
    torch.manual_seed(0)
    import shardc
    model = Net()
    if not plain:
        shardc.shard(model)
    fwd = torch.compile(model, backend="aot_eager" if plain else shardc.backend(inductor=False))
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(3):
            n = 5 - (rank + step) % 3
            if step == 2 and rank == 1:
                base = torch.randint(0, 11, (3, 6, n), generator=g)[2]  # a view of a 3-D tensor
            else:
                base = torch.randint(0, 11, (6, n), generator=g)
            fwd(base[0:4]).sum().backward()
            print(f"rank {rank} step {step} length {n} ok", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    os._exit(0)


if __name__ == "__main__":
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(2, init, os.environ.get("PLAIN") == "1"), nprocs=2)
