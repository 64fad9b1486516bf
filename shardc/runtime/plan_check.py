"""Fail loudly, on every rank, when ranks planned different collectives (instead of hanging)."""

from __future__ import annotations

import torch.distributed as dist

from shardc.plan import Plan
from shardc.runtime.collectives import resolve_group


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans; running them would hang or corrupt gradients."""


def _describe(sig: tuple | None) -> str:
    if sig is None:
        return "nothing (fewer collectives)"
    cid, kind, graph, bucket, params, nbytes, dtype = sig
    shown = ", ".join(params[:4]) + (", ..." if len(params) > 4 else "")
    return f"{kind} {cid} of bucket {bucket} [{shown}] ({nbytes} B, {dtype}) in {graph}"


def check_plan_consistency(plan: Plan) -> None:
    """All-gather every rank's plan signature and raise :class:`PlanMismatchError` if any differ.

    Every rank runs this at the first call of a compiled region, so all of them raise together,
    naming the first rank and the first collective that differ from rank 0's plan.
    """
    if not plan.group_name:
        return
    group = resolve_group(plan.group_name)
    world = dist.get_world_size(group)
    if world == 1:
        return
    mine = (plan.region, plan.hash(), plan.collective_signature())
    every: list = [None] * world
    dist.all_gather_object(every, mine, group=group)
    region0, hash0, sig0 = every[0]
    for rank, (region, digest, sig) in enumerate(every):
        if digest == hash0 and region == region0:
            continue
        index = next(
            (i for i in range(max(len(sig), len(sig0)))
             if (sig[i] if i < len(sig) else None) != (sig0[i] if i < len(sig0) else None)),
            0,
        )
        theirs = sig[index] if index < len(sig) else None
        ref = sig0[index] if index < len(sig0) else None
        raise PlanMismatchError(
            f"shardc: rank {rank}'s plan for compiled region {region} differs from rank 0's "
            f"(region {region0}) at collective #{index}: rank 0 has {_describe(ref)}, "
            f"rank {rank} has {_describe(theirs)}. Ranks must trace the same graph: remove "
            "rank-dependent control flow or shapes from the compiled model."
        )
