"""s76: the eager-body fix at uneven worlds: _WrappedContextStack (checkpoint_wrapper around a
kernels-like attention, Linear(8, 8): 8 rows over 3 ranks is 3/3/2) trained 3 SGD steps through
shardc (FX and Inductor) against the unsharded model on the whole batch (each rank its own rows,
the gradients averaged over ranks, as FSDP2 does). ``--input-without-grad`` (s77): the first
block's input does not require grad, and each case runs with and without torch's
skip_fwd_side_effects_in_bwd_under_checkpoint (the reuse-key fix, docs/bench/s77)."""
import copy
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, "tests")  # run from the checkout (summary.md has the command)


def run(rank, world, inductor, skip=False, input_grad=True):
    import test_blocks as T

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = skip

    import shardc

    torch.manual_seed(0)
    model = T._WrappedContextStack()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    shardc.shard(model, mesh)
    compiled = torch.compile(model, backend=shardc.backend(inductor=inductor))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(3):
        x = torch.randn(world * 2, 8, generator=g).requires_grad_(input_grad)
        reference(x).pow(2).mean().backward()
        mine = x.detach()[rank * 2:(rank + 1) * 2].clone().requires_grad_(input_grad)
        compiled(mine).pow(2).mean().backward()  # shardc averages gradients over ranks
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for (_name, p), r in zip(model.named_parameters(), reference.parameters()):
            full = p.full_tensor()
            worst = max(worst, ((full - r).abs().max() / r.abs().max()).item())
    bodies = [tuple(b.blocks) for plan in shardc.explain_all(compiled) for b in plan.bodies]
    return worst, bodies


if __name__ == "__main__":
    from dist_utils import run_ranks
    input_grad = "--input-without-grad" not in sys.argv
    skips = (False,) if input_grad else (False, True)
    for world in (2, 3):
        for skip in skips:
            for inductor in (False, True):
                out = run_ranks(run, world, inductor, skip, input_grad)
                print(f"world {world} inductor={inductor}"
                      + ("" if input_grad else f" skip={skip}") + ": max rel param error "
                      f"{max(o[0] for o in out):.2e}, bodies {out[0][1]}", flush=True)
