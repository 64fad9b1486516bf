"""One step of a probe scenario at world 1: eager unsharded (the reference) against
``torch.compile`` (Inductor, no shardc), shardc FX, shardc Inductor packed and per-parameter.
PYTHONPATH=.:tests:docs/bench/compat_s74 python docs/bench/compat_s74/inductor_buffers_repro.py
buffers_eval torch_inductor,fx,ind,ind_nopack"""
import sys

import probe
import torch
import torch._dynamo
import torch.nn.functional as F
from dist_utils import one_rank_mesh

import shardc


def step(model, forward):
    tokens, targets, _ = probe.data()
    x, y = tokens[0], targets[0]
    out = forward(x)
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    g = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
         for n, p in model.named_parameters()}
    b = {n: t.clone() for n, t in model.named_buffers()}
    return loss.item(), g, b

if __name__ == "__main__":
    torch.set_num_threads(1)
    sc = probe.SCENARIOS[sys.argv[1]]
    ref = step(m := probe.build(sc), m)
    runs = {}
    for kind in sys.argv[2].split(","):
        torch._dynamo.reset()
        m = probe.build(sc)
        if kind == "torch_inductor":
            runs[kind] = step(m, torch.compile(m))
            continue
        with one_rank_mesh() as mesh:
            pack = not kind.endswith("nopack")
            shardc.shard(m, mesh, pack_blocks=pack)
            f = torch.compile(m, backend=shardc.backend(inductor=kind.startswith("ind")))
            runs[kind] = step(m, f)
    for kind, (loss, g, b) in runs.items():
        errs = {n: probe.rel(g[n], ref[1][n]) for n in ref[1]}
        berr = {n: probe.rel(b[n].float(), ref[2][n].float()) for n in ref[2]}
        print(kind, "loss", loss, ref[0], "max grad rel", max(errs.values()), "buffers",
              max(berr.values(), default=0))
        print("   ", {n: f"{e:.1e}" for n, e in berr.items()})
