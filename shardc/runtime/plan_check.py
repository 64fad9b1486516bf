"""Fail loudly, on every rank, when ranks planned different collectives (instead of hanging).

Each rank numbers the regions it compiles per process group (:func:`announce_region`, called by
the backend as a compile starts, which also marks ``<n>`` as compiled in the group's store). The
count lives in the group's store too (one counter per rank), so it belongs to the process group
and goes with it: no module-level registry. At
the first call of region ``n`` every rank publishes its plan's signature in the group's store and
waits, up to the group's timeout, for every other rank's ``n``-th signature. This is not a
collective, so it cannot pair with another collective when only some ranks compiled a new region
(a recompile for a shape seen on some ranks only): those ranks raise :class:`PlanMismatchError`
naming the ranks that did not compile it, and the others, whose next collective then times out,
find the extra region in the store (:func:`recompiled_elsewhere`, used by
:mod:`shardc.runtime.comm_errors`) and raise the same error.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch.distributed as dist

from shardc.planning.plan import Plan
from shardc.runtime.collectives import group_store, group_timeout, resolve_group

# How long a rank whose collective failed looks for a region another rank compiled and it did not
# (at most the group's timeout): covers a rank still compiling when the collective timed out.
RECOMPILE_GRACE = timedelta(seconds=10)

_FIX = (
    "Ranks must compile the same regions in the same order: a shape that differs between ranks "
    "(e.g. the number of tokens routed to an expert after a graph break at nonzero) recompiles on "
    "some ranks only. Capture data-dependent shapes in the graph "
    "(torch._dynamo.config.capture_dynamic_output_shape_ops = True), mark varying dimensions "
    "dynamic (torch._dynamo.mark_dynamic) or pad them to a size every rank shares."
)


class PlanMismatchError(RuntimeError):
    """Ranks hold different plans or compiled different regions; running them would hang or
    corrupt gradients."""


def _describe(sig: tuple | None) -> str:
    if sig is None:
        return "nothing (fewer collectives)"
    cid, kind, graph, bucket, params, nbytes, dtype = sig
    if bucket is None:  # found in the traced graph (e.g. tensor parallelism): no bucket
        return f"{kind} {cid} ({dtype}) in {graph}, found in the traced graph"
    shown = ", ".join(params[:4]) + (", ..." if len(params) > 4 else "")
    return f"{kind} {cid} of bucket {bucket} [{shown}] ({nbytes} B, {dtype}) in {graph}"


def _key(what: str, index: int, rank: int) -> str:
    return f"shardc/{what}/{index}/{rank}"


def _group(group_name: str) -> tuple[dist.ProcessGroup, int, int] | None:
    if not group_name:
        return None
    group = resolve_group(group_name)
    world = dist.get_world_size(group)
    return (group, dist.get_rank(group), world) if world > 1 else None


def _announced(store: dist.Store, rank: int, add: int = 0) -> int:
    """How many regions ``rank`` has announced over the store's group, after adding ``add``."""
    return store.add(f"shardc/announced/{rank}", add)


def announce_region(group_name: str) -> int:
    """Number the region this rank starts compiling over ``group_name`` and record in the
    group's store that this rank compiles it; returns the number (0, 1, ...; always 0 for a
    group of one rank, which has nothing to check)."""
    found = _group(group_name)
    if found is None:
        return 0
    group, me, _ = found
    store = group_store(group)
    index = _announced(store, me, 1) - 1
    store.set(_key("compiled", index, me), b"1")
    return index


def check_plan_consistency(plan: Plan, index: int, timeout: timedelta | None = None) -> None:
    """Compare every rank's plan signature for this rank's region ``index`` (from
    :func:`announce_region`) through the group's store. Raises :class:`PlanMismatchError` if
    any differs, or if some rank publishes none within ``timeout`` (default: the group's
    timeout) because it did not compile this region.

    Every rank runs this at the first call of a compiled region, so all of them raise together,
    naming the first rank and the first collective that differ from rank 0's plan.
    """
    found = _group(plan.group_name)
    if found is None:
        return
    group, me, world = found
    store = group_store(group)
    mine = (plan.region, plan.hash(), plan.collective_signature(), plan.budget_signature())
    store.set(_key("plan", index, me), pickle.dumps(mine))
    keys = [_key("plan", index, r) for r in range(world)]
    timeout = timeout or group_timeout(group)
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:  # DistStoreError: some rank did not publish in time
        missing = [r for r in range(world) if not store.check([keys[r]])]
        if missing:
            raise PlanMismatchError(
                f"shardc: rank {me} compiled region {plan.region} (its region #{index} over "
                f"its process group), but rank(s) {missing} did not run one there within "
                f"{timeout.total_seconds():g} s: ranks recompiled differently. {_FIX}"
            ) from exc
    every = [pickle.loads(store.get(k)) for k in keys]
    region0, hash0, sig0, budget0 = every[0]
    for rank, (region, digest, sig, budget) in enumerate(every):
        if digest == hash0 and region == region0:
            continue
        if sig == sig0 and budget != budget0:
            raise PlanMismatchError(
                f"shardc: rank {rank}'s peak-budget decisions for compiled region {region} "
                f"differ from rank 0's: rank 0 has (budget bytes, kept buckets[, recomputed "
                f"blocks][, margin]) {budget0}, rank {rank} has {budget}. Pass the same "
                "peak_memory_budget_bytes and peak_memory_margin on every rank; if they are "
                "the same, the ranks' predicted peaks straddle a decision "
                "threshold (uneven shards, docs/memory_budget.md): move the budget slightly."
            )
        first = next(
            (i for i in range(max(len(sig), len(sig0)))
             if (sig[i] if i < len(sig) else None) != (sig0[i] if i < len(sig0) else None)),
            0,
        )
        theirs = sig[first] if first < len(sig) else None
        ref = sig0[first] if first < len(sig0) else None
        raise PlanMismatchError(
            f"shardc: rank {rank}'s plan for compiled region {region} differs from rank 0's "
            f"(region {region0}) at collective #{first}: rank 0 has {_describe(ref)}, "
            f"rank {rank} has {_describe(theirs)}. Ranks must trace the same graph: remove "
            "rank-dependent control flow or shapes from the compiled model."
        )


def recompiled_elsewhere(group_name: str) -> list[int]:
    """Ranks of the group that compiled a region this rank did not (their next region number
    is in the store, this rank's is not), looking up to :data:`RECOMPILE_GRACE` for one; for
    the error of a collective that failed. Empty if none did."""
    found = _group(group_name)
    if found is None:
        return []
    group, me, world = found
    store = group_store(group)
    index = _announced(store, me)
    others = [r for r in range(world) if r != me]
    wait = min(RECOMPILE_GRACE, group_timeout(group)).total_seconds()
    deadline = time.monotonic() + wait
    while True:
        ranks = [r for r in others if store.check([_key("compiled", index, r)])]
        if ranks or time.monotonic() >= deadline:
            return ranks
        time.sleep(0.05)  # polling the store: only after a collective has failed


def recompile_message(group_name: str, ranks: list[int], what: str) -> str:
    """The :class:`PlanMismatchError` message for this rank, whose ``what`` failed because
    ``ranks`` compiled a region it did not."""
    group = resolve_group(group_name)
    me = dist.get_rank(group)
    index = _announced(group_store(group), me) if dist.get_world_size(group) > 1 else 0
    return (f"shardc: {what} failed on rank {me} because rank(s) {ranks} compiled a region "
            f"that rank {me} did not (region #{index} over this process "
            f"group): ranks recompiled differently. {_FIX}")


def agree_on_largest(group_name: str, index: int, tag: str, value: int,
                     timeout: timedelta | None = None) -> int:
    """The largest of every rank's ``value`` for this rank's region ``index`` (from
    :func:`announce_region`), exchanged through the group's store under ``tag`` (each tag once
    per region): the budget planner compares the ranks' largest predicted peak with the
    budget, so that every rank makes the same decisions although uneven shards make their
    predictions differ by a few bytes. A group of one rank (or none) returns ``value``.
    Raises :class:`PlanMismatchError` if some rank publishes nothing within ``timeout``
    (default: the group's timeout): it did not plan this region the same way."""
    if _group(group_name) is None or index is None:
        return value
    return agree_on_largest_each(group_name, index, tag, [value], timeout)[0]


def agree_on_largest_each(group_name: str, index: int, tag: str, values: list[int],
                          timeout: timedelta | None = None) -> list[int]:
    """:func:`agree_on_largest` of a list in one store exchange: per position, the largest of
    every rank's ``values`` (each rank passes as many; a rank that passes another count did not
    plan the region the same way: :class:`PlanMismatchError`)."""
    found = _group(group_name)
    if found is None or index is None:
        return list(values)
    group, me, world = found
    store = group_store(group)
    store.set(_key(f"budget/{tag}", index, me), ",".join(str(int(v)) for v in values))
    keys = [_key(f"budget/{tag}", index, r) for r in range(world)]
    timeout = timeout or group_timeout(group)
    try:
        store.wait(keys, timeout)
    except RuntimeError as exc:  # DistStoreError: some rank did not publish in time
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise PlanMismatchError(
            f"shardc: rank {me} planned region {index} under a peak budget (step {tag!r}), but "
            f"rank(s) {missing} did not within {timeout.total_seconds():g} s: every rank must "
            f"pass the same peak_memory_budget_bytes and compile the same regions. {_FIX}"
        ) from exc
    ranks = [[int(v) for v in store.get(k).decode().split(",") if v] for k in keys]
    if any(len(got) != len(values) for got in ranks):
        raise PlanMismatchError(
            f"shardc: rank {me} planned region {index} under a peak budget (step {tag!r}) with "
            f"{len(values)} value(s), but the ranks passed {[len(got) for got in ranks]}: "
            f"every rank must compile the same regions. {_FIX}")
    return [max(column) for column in zip(*ranks)] if values else []
