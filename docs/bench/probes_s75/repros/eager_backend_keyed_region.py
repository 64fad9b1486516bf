"""s75 repro (G): torch.compile(sharded_model, backend="eager") fails in the backward.

Run: cd <worktree> && python docs/bench/probes_s75/repros/eager_backend_keyed_region.py
Seen (torch 2.13, s75), one process:
  shardc-sharded model (packed or not), backend="eager": AssertionError "fake_mode should be
    enabled for HOPs" from torch/_higher_order_ops/invoke_subgraph.py (backward);
    backend="aot_eager" and plain backend="inductor": ok.
  No shardc: a torch.compiler.nested_compile_region function that takes the weights as
    arguments (as shardc's block bodies do; with or without reuse_hash_fn, which shardc's
    keyed_compile_region adds, shardc/_torch.py) under backend="eager": the same AssertionError;
    aot_eager ok. (A region decorating a module's forward that reads self.l's weights inside
    worked under eager: /tmp check in the s75 session.) So torch's bug, reached through shardc's
    block regions, which shardc installs whatever backend the user compiles with
    (backend="eager" is a usual first debugging step). An earlier version of this script with
    blocks nn.Sequential(nn.Linear) passed under eager for shardc: not every model reaches it.
"""
import os

import torch
import torch.distributed as dist
from torch import nn


class Net(nn.Module):  # the model of rank_view_recompile.py
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, t):
        h = self.embed(t)
        for b in self.blocks:
            h = h + b(h)
        return h


def body(key, x, w, b):
    return x + torch.nn.functional.linear(x, w, b)


class Plain(nn.Module):
    def __init__(self, keyed):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        kw = {"reuse_hash_fn": lambda key, *a, **k: key} if keyed else {}
        self.region = torch.compiler.nested_compile_region(body, **kw)

    def forward(self, x):
        for lin in self.blocks:
            x = self.region(7, x, lin.weight, lin.bias)
        return x


def attempt(label, model, backend):
    x = torch.randint(0, 11, (4, 5)) if isinstance(model, Net) else torch.randn(3, 8)
    try:
        torch.compile(model, backend=backend)(x).sum().backward()
        print(f"{label}, backend={backend}: ok", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"{label}, backend={backend}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import shardc
    for backend in ("eager", "aot_eager", "inductor"):
        for pack in (True, False):
            torch.manual_seed(0)
            m = Net()
            shardc.shard(m, pack_blocks=pack)
            attempt(f"shardc.shard(pack_blocks={pack})", m, backend)
    for keyed in (True, False):
        for backend in ("eager", "aot_eager"):
            attempt(f"no shardc, nested_compile_region keyed={keyed}", Plain(keyed), backend)
    dist.destroy_process_group()
