"""s75 repro: torch.optim.Adafactor and LBFGS on sharded parameters, with and without shardc.

Run: cd <worktree> && python docs/bench/probes_s75/repros/adafactor_lbfgs_dtensor.py
Two gloo ranks. For each optimizer: (a) a plain DTensor Shard(0) parameter (what FSDP2's
fully_shard makes; no shardc at all), (b) shardc.shard of a one-Linear model, compiled with
the FX backend. Seen (torch 2.13, s75):
  Adafactor, (a) and (b): RuntimeError from DTensor: "aten.pow_.Scalar: in-place operations
    that require placement changes are not supported ... _NormPartial(2)" (torch's
    _single_tensor_adafactor: torch.norm(grad, dim=-2, keepdim=True).square_()): torch's DTensor.
  LBFGS, (a) and (b): RuntimeError from DTensor: "Cannot flatten unevenly sharded tensor"
    (LBFGS._gather_flat_grad: p.grad.view(-1); rows 5 over 2 ranks), and under (b) shardc first
    warns "LBFGS.step() found no gradient on any of its parameters ... Call backward() and read
    .grad, or shard with plain_inputs=False": wrong advice, LBFGS computes its gradients in
    the closure, after the pre-step hook that warns (shardc/optim/default_local_step.py,
    _say_if_no_gradient_reached, called from _pre_step for step(closure) too).
"""
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


def attempt(label, fn):
    try:
        fn()
        print(f"rank {dist.get_rank()} {label}: ok", flush=True)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc).strip().splitlines()[0]
        print(f"rank {dist.get_rank()} {label}: {type(exc).__name__}: {msg[:200]}", flush=True)
        if os.environ.get("TB"):
            traceback.print_exc()


def worker(rank, world, init):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))

    def plain(opt_cls, **kw):
        def run():
            w = nn.Parameter(distribute_tensor(torch.randn(5, 4), mesh, [Shard(0)]))
            opt = opt_cls([w], **kw)
            if opt_cls is torch.optim.LBFGS:
                def closure():
                    opt.zero_grad()
                    loss = (w.full_tensor() ** 2).sum() if False else (w * w).sum()
                    loss.backward()
                    return loss
                opt.step(closure)
            else:
                w.grad = distribute_tensor(torch.randn(5, 4), mesh, [Shard(0)])
                opt.step()
        return run

    def with_shardc(opt_cls, **kw):
        def run():
            import shardc
            model = nn.Sequential(nn.Linear(4, 5))
            shardc.shard(model, mesh)
            fwd = torch.compile(model, backend=shardc.backend(inductor=False))
            opt = opt_cls(model.parameters(), **kw)
            x = torch.randn(3, 4)
            if opt_cls is torch.optim.LBFGS:
                def closure():
                    opt.zero_grad()
                    loss = fwd(x).square().mean()
                    loss.backward()
                    return loss
                opt.step(closure)
            else:
                fwd(x).square().mean().backward()
                opt.step()
        return run

    attempt("Adafactor, plain DTensor", plain(torch.optim.Adafactor, lr=1e-2))
    attempt("Adafactor, shardc", with_shardc(torch.optim.Adafactor, lr=1e-2))
    attempt("LBFGS, plain DTensor", plain(torch.optim.LBFGS, lr=0.1, max_iter=2))
    attempt("LBFGS, shardc", with_shardc(torch.optim.LBFGS, lr=0.1, max_iter=2))
    def lbfgs_even():  # every size divisible by the world: does LBFGS run, and is it right?
        torch.manual_seed(1)
        w0, t = torch.randn(4, 4), torch.randn(4, 4)
        outs = []
        for sharded in (False, True):
            w = nn.Parameter(distribute_tensor(w0.clone(), mesh, [Shard(0)]) if sharded
                             else w0.clone())
            opt = torch.optim.LBFGS([w], lr=0.5, max_iter=4)

            def closure():
                opt.zero_grad()
                loss = ((w - (distribute_tensor(t, mesh, [Shard(0)]) if sharded else t)) ** 3
                        ).abs().sum()
                loss.backward()
                return loss
            for _ in range(2):
                opt.step(closure)
            outs.append(w.full_tensor() if sharded else w.detach())
        err = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
        print(f"rank {dist.get_rank()} LBFGS even sizes, plain DTensor vs unsharded: rel {err:.2e}",
              flush=True)
    attempt("LBFGS even sizes", lbfgs_even)
    dist.destroy_process_group()


if __name__ == "__main__":
    init = os.path.join(tempfile.mkdtemp(), "init")
    mp.spawn(worker, args=(2, init), nprocs=2)
