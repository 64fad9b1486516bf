"""The whole-step memory budget: which buckets stay gathered from the forward to the backward.

With ``peak_memory_budget_bytes`` set, the planner trades memory for time with one lever today:
per bucket, keep its gathered parameters alive from their forward use to their backward use
(the backward gathers nothing for it: its all-gather's time is saved, its gathered bytes are
held through the forward-backward boundary, where the step's activations peak) or reshard them
after the forward (the fixed policy's choice). The decision is a deterministic greedy:

1. Evaluate the cheapest-memory configuration (every bucket resharded): its predicted peak is
   the feasible minimum. Over the budget, the fully kept configuration is tried once (keeping
   removes the backward's re-gather buffers, which can be what makes the peak): if it fits, it
   is the plan (:func:`keep_all`); otherwise the budget is refused (:class:`MemoryBudgetError`,
   naming the lower of the two peaks and its largest terms).
2. Rank the buckets by predicted time saved per byte held (the backward all-gather's time by
   the cost model, or for a one-rank group, whose gathers are elided, the backward's re-cast of
   the shards to the compute dtype; under CPU offload also the backward's host->device copy of
   the bucket's shards; over the bucket's gathered bytes; ties by bucket index) and keep them
   in that order while the estimated peak (the last verified peak plus the kept bytes, scaled
   by what a kept byte verifiably added so far, at least :data:`MIN_SCALE`) stays within the
   budget.
3. Verify by planning and predicting the chosen configuration (a partition, a plan and a peak
   prediction: :func:`choose` calls ``evaluate``), at most :data:`MAX_TRIALS` times: over the
   budget, drop the lowest-ranked kept buckets until their bytes cover the excess; within it,
   add the next buckets that fit in the measured slack. If no verified configuration keeps
   anything, every bucket is resharded (the minimum, known to fit).

The work is bounded by a count (never a clock), and every input the decisions read is the same
on every rank: the buckets' global sizes, the cost model's collective times (functions of
those sizes), and the verified peaks, which are the largest over the ranks (uneven shards make
the ranks' predictions differ by a few bytes; ``shardc.runtime.plan_check.agree_on_largest``
exchanges them through the process group's store, as the plan check does). The plan records
the decisions (``Plan.budget``) and its hash covers them, so the cross-rank plan check compares
them too.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch

from shardc import _torch
from shardc.planning.plan import BucketDecision, CollectiveKind, MemoryBudget, Plan

MAX_TRIALS = 4  # verifying partitions after the fully resharded one, whatever the model
# "auto": the device's capacity less what the prediction does not count (the CUDA context,
# the allocator's fragmentation, the communication library's own buffers).
AUTO_MARGIN_FRACTION = 0.10
AUTO_MARGIN_MIN_BYTES = 2 << 30

MIN_SCALE = 0.25
_MiB = float(1 << 20)


class MemoryBudgetError(ValueError):
    """The peak budget is below what the plan can reach, or cannot be resolved.
    ``minimum_bytes``: the feasible minimum it names; ``resharded_bytes``: the fully resharded
    plan's peak (the fixed policy's; None where not known); ``resharded_by_depth``: the fully
    resharded plan's peak at each prefetch depth tried (``shardc.planning.prefetch``)."""

    minimum_bytes: int | None = None
    resharded_bytes: int | None = None
    resharded_by_depth: dict[int, int] | None = None


@dataclass(frozen=True)
class Candidate:
    """A bucket the planner may keep gathered: what keeping it saves and costs."""

    bucket: int
    name: str
    params: tuple[str, ...]
    saved_s: float  # predicted backward time removed: all-gathers and host->device copies
    nbytes: int  # gathered bytes held from the forward to the backward
    copy_s: float = 0.0  # of saved_s, the backward's host->device copies (CPU offload)
    # Its gathers are elided (one-rank group): the rest of ``saved_s`` is the backward's re-cast.
    elided: bool = False

    def saves(self) -> str:
        """What keeping the bucket saves, in words (for its decision's reason)."""
        rest_ms, copy_ms = (self.saved_s - self.copy_s) * 1e3, self.copy_s * 1e3
        what = ("of re-casting in the backward (its gathers are elided: one-rank group)"
                if self.elided else "of backward all-gather")
        if not copy_ms:
            return f"{rest_ms:.3f} ms {what}"
        return f"{rest_ms:.3f} ms {what} and {copy_ms:.3f} ms of host->device copy (CPU offload)"

    @property
    def ratio(self) -> float:
        return self.saved_s / max(self.nbytes, 1)


def _gathered_bytes(plan: Plan, bucket: int, params: set[str]) -> int:
    b = plan.buckets[bucket]
    size = getattr(torch, b.dtype.removeprefix("torch."), torch.float32).itemsize
    return sum(d * n * size for fqn, d, n in zip(b.params, b.dim0, b.row_numel) if fqn in params)


def candidates(plan: Plan, cast_seconds: Mapping[str, float] | None = None
               ) -> tuple[list[Candidate], list[BucketDecision]]:
    """The buckets of a fully resharded plan that the backward gathers again (candidates), and
    decisions for those whose backward gathers save nothing when kept.

    A gather over a one-rank group (elided: world 1, or HSDP with shard size 1) communicates
    nothing, but where the compute dtype differs from the shard's it is a cast of the shard
    (``shardc.passes.lower.elide``): re-gathering in the backward casts every parameter again,
    which keeping the forward's cast saves. ``cast_seconds``: per parameter, that cast's
    predicted device time (``shardc.planning.estimate.elided_cast_seconds``); a parameter not in it
    costs nothing to re-gather (no cast: the gathered parameter is the shard itself).

    Under CPU offload a bucket the backward gathers again also copies its host shards to the
    device again: keeping it gathered saves that copy too, even where its gathers are elided
    and cast nothing (then it is a candidate for the copy alone)."""
    cast = cast_seconds or {}
    by_bucket: dict[int, list] = {}
    for c in plan.collectives:
        if c.origin == "shardc" and c.kind == CollectiveKind.ALL_GATHER and c.graph == "backward":
            by_bucket.setdefault(c.bucket, []).append(c)
    copy_s: dict[int, float] = {}
    for c in plan.copies:
        if c.kind == CollectiveKind.H2D_COPY and c.graph == "backward" and c.origin == "shardc":
            copy_s[c.bucket] = copy_s.get(c.bucket, 0.0) + c.predicted_s
    out, fixed = [], []
    for index in sorted(by_bucket):
        colls = by_bucket[index]
        params = sorted({p for c in colls for p in c.params})
        nbytes = _gathered_bytes(plan, index, set(params))
        name = plan.buckets[index].name
        copies = copy_s.get(index, 0.0)
        if all(c.elided for c in colls):
            recast = sum(cast.get(p, 0.0) for c in colls for p in c.params)
            if recast + copies <= 0:
                fixed.append(BucketDecision(index, name, False, 0.0, nbytes,
                                            "resharded: its gathers are elided (one-rank group) "
                                            "and read the shard itself, keeping it would save no "
                                            "time", params))
                continue
            out.append(Candidate(index, name, tuple(params), recast + copies, nbytes, copies,
                                 elided=True))
            continue
        saved = sum(c.predicted_s for c in colls if not c.elided) + copies
        out.append(Candidate(index, name, tuple(params), saved, nbytes, copies))
    return out, fixed


def _one_plus(margin: float) -> Fraction:
    """``1 + margin`` exactly as written (0.02 is 1/50, not the float nearest it), so that the
    bytes below are exact integers, the same on every rank and every machine."""
    return 1 + Fraction(repr(float(margin)))


def planned_for(budget: int, margin: float) -> int:
    """The bytes the planner plans for under ``budget``: ``budget / (1 + margin)``, rounded
    down, so that a measured peak at most ``margin`` (a fraction) above a predicted peak within
    them is within ``budget``. The margin is ``budget - planned_for(budget, margin)``."""
    return budget if margin <= 0 else math.floor(budget / _one_plus(margin))


def smallest_budget(minimum: int, margin: float) -> int:
    """The smallest budget whose planned-for bytes (:func:`planned_for`) reach ``minimum``: the
    feasible minimum plus the margin, ``minimum * (1 + margin)`` rounded up."""
    return minimum if margin <= 0 else math.ceil(minimum * _one_plus(margin))


def with_margin(decided: MemoryBudget, budget: int, margin: float) -> MemoryBudget:
    """``decided`` (made against the planned-for bytes) recorded against the user's
    ``budget``, with the margin in bytes and as a fraction."""
    decided.budget_bytes = budget
    decided.margin_bytes = budget - planned_for(budget, margin)
    decided.margin_fraction = float(margin)
    return decided


def refuse_below_minimum(budget: int, minimum: int, plan: Plan, *, recomputed: int = 0,
                         offloaded: int = 0, margin: float = 0.0,
                         resharded: int | None = None, checkpoints: int = 0,
                         left_out: int = 0) -> MemoryBudgetError:
    """The error for a budget whose planned-for bytes (``budget`` less the ``margin`` for the
    prediction's error, :func:`planned_for`) are below the feasible minimum (the peak of
    ``plan``: the fully resharded plan with every one of its ``recomputed`` candidate blocks
    recomputed (and ``checkpoints`` of them with their checkpoints offloaded), or every
    candidate but the ``left_out`` ranked last freed, or, where lower, the fully resharded or
    fully kept plan), naming the smallest budget accepted (the minimum plus the margin) and the
    minimum's largest terms."""
    at = plan.memory_by_category.get("peak") or {}
    terms = sorted(((int(v), c) for c, v in (at.get("bytes") or {}).items() if v),
                   reverse=True)
    parts = ", ".join(f"{c} {v / _MiB:.1f} MiB" for v, c in terms[:4])
    largest = ", ".join(f"{name} ({cat}) {n / _MiB:.2f} MiB"
                        for name, cat, n in (at.get("largest") or [])[:3])
    where = f"{at.get('graph', '?')} at op {at.get('position', '?')}"
    target, smallest = planned_for(budget, margin), smallest_budget(minimum, margin)
    less = (f" less its margin for the prediction's error ({margin:.1%}, peak_memory_margin: "
            f"{budget - target} B) leaves {target} B ({target / _MiB:.1f} MiB), which"
            if margin > 0 else "")
    error = MemoryBudgetError(
        f"shardc: peak_memory_budget_bytes={budget} ({budget / _MiB:.1f} MiB){less} is below "
        f"the feasible minimum {minimum} B ({minimum / _MiB:.1f} MiB): the smallest budget "
        f"accepted is {smallest} B ({smallest / _MiB:.1f} MiB"
        + (f", the minimum plus the {margin:.1%} margin" if margin > 0 else "")
        + f"). The minimum is the predicted peak of region "
        f"{plan.region} with every bucket {kept_or_resharded(plan)}{_depth(plan)}"
        + _freed(recomputed, offloaded, left_out)
        + (f" and the checkpoints of those recomputed ({checkpoints}) offloaded to host memory"
           if checkpoints else "") + "; the peak is in the "
        f"{where}: {parts}" + (f"; its largest values: {largest}" if largest else "")
        + ". Raise the budget, or lower what dominates (a smaller batch or sequence, "
        "more ranks" + ("" if recomputed or offloaded else ", activation checkpointing")
        + ").")
    # What the last lever (the optimizer's state on the host, shardc.planning.optimizer_offload)
    # starts from: the minimum and the plan that makes it.
    error.minimum_bytes, error.resharded_bytes, error.plan = minimum, resharded, plan
    return error


def _freed(recomputed: int, offloaded: int, left_out: int) -> str:
    """The blocks the minimum's plan frees, as the refusal names them."""
    if left_out:  # a prefix of the ranking (shardc.compile.budget_search.shorter_prefixes)
        return (f" and every candidate block but the last {left_out} by the ranking freed "
                f"({recomputed} recomputed in the backward, {offloaded} offloaded to host "
                "memory; freeing those too raises the peak)")
    return ((f" and every block that can be recomputed ({recomputed}) recomputed in the "
             "backward" if recomputed else "")
            + (f" and every block that can be offloaded ({offloaded}) offloaded to host memory"
               if offloaded else ""))


def _depth(plan: Plan) -> str:
    """The plan's prefetch depth, where it is not the default (one bucket ahead)."""
    depth = plan.options.get("prefetch_depth", 1) if plan.options.get("prefetch", True) else 0
    return "" if depth == 1 else ", with no prefetch" if depth == 0 else \
        f", prefetching {depth} buckets ahead"


def kept_or_resharded(plan: Plan) -> str:
    """How the plan treats its buckets: resharded after the forward, or (no all-gather in its
    backward) kept gathered to the backward."""
    regathered = any(c.origin == "shardc" and c.kind == CollectiveKind.ALL_GATHER
                     and c.graph == "backward" for c in plan.collectives)
    return ("resharded after the forward" if regathered or not plan.collectives
            else "kept gathered from the forward to the backward")


def _fit(order: list[Candidate], chosen: list[Candidate], base: int, budget: int,
         scale: float = 1.0) -> list[Candidate]:
    """``chosen`` plus, in ``order``, every other candidate whose bytes times ``scale`` still
    fit on ``base`` (the verified peak with ``chosen`` kept)."""
    total = base
    out = list(chosen)
    for c in order:
        if c not in chosen and total + c.nbytes * scale <= budget:
            out.append(c)
            total += c.nbytes * scale
    return sorted(out, key=order.index)


def _scale(chosen: list[Candidate], peak: int, minimum: int) -> float:
    """What a kept byte verifiably added to the peak (keeping a bucket adds less than its bytes
    where the backward's re-gather buffers it removes were part of the peak), never below
    :data:`MIN_SCALE`: the next estimates' bytes-per-byte."""
    held = sum(c.nbytes for c in chosen)
    return 1.0 if not held else min(1.0, max(MIN_SCALE, (peak - minimum) / held))


def _saved(chosen: list[Candidate]) -> float:
    return sum(c.saved_s for c in chosen)


def choose(cands: list[Candidate], fixed: list[BucketDecision], budget: int, minimum: int,
           evaluate: Callable[[tuple[int, ...]], int]) -> MemoryBudget:
    """The decisions under ``budget`` (see the module docstring). ``minimum``: the verified
    peak with nothing kept; ``evaluate(kept bucket indices)`` plans that configuration and
    returns its rank-uniform peak."""
    order = sorted((c for c in cands if c.saved_s > 0), key=lambda c: (-c.ratio, c.bucket))
    best: list[Candidate] = []
    best_peak = minimum
    verified: dict[tuple[int, ...], int] = {(): minimum}
    chosen = _fit(order, [], minimum, budget)
    if not chosen and order:
        # Nothing fits by its bytes: probe the best-ranked bucket alone, since keeping one
        # often adds less than its bytes to the peak; the probe measures by how much.
        chosen = order[:1]
    trials = 0
    while trials < MAX_TRIALS:
        key = tuple(c.bucket for c in chosen)
        if key in verified:
            break
        peak = verified[key] = evaluate(key)
        trials += 1
        if peak <= budget:
            if (_saved(chosen), -peak) > (_saved(best), -best_peak):
                best, best_peak = chosen, peak
            chosen = _fit(order, chosen, peak, budget, _scale(chosen, peak, minimum))
        else:
            excess = peak - budget
            chosen = list(chosen)
            while chosen and excess > 0:
                excess -= chosen.pop().nbytes
    kept = {c.bucket for c in best}
    decisions = list(fixed)
    for c in cands:
        saved_ms = c.saved_s * 1e3
        if c.bucket in kept:
            reason = (f"kept gathered: saves {c.saves()} for "
                      f"{c.nbytes / _MiB:.2f} MiB held to the backward; verified peak "
                      f"{best_peak / _MiB:.1f} MiB within the budget")
        elif c.saved_s <= 0:
            reason = "resharded: keeping it would save no predicted time"
        elif any(c.bucket in k for k, p in verified.items() if p > budget):
            reason = ("resharded: a verified plan keeping it exceeded the budget; it saves "
                      f"{c.ratio * 1e3 * _MiB:.4f} ms/MiB, ranked after those kept")
        else:
            reason = ("resharded: keeping it too would put the estimated peak over the budget "
                      f"({c.ratio * 1e3 * _MiB:.4f} ms/MiB)")
        decisions.append(BucketDecision(c.bucket, c.name, c.bucket in kept, saved_ms, c.nbytes,
                                        reason, list(c.params)))
    decisions.sort(key=lambda d: d.bucket)
    return MemoryBudget(budget, minimum, best_peak, trials, decisions)


def keep_all(cands: list[Candidate], fixed: list[BucketDecision], budget: int, minimum: int,
             peak: int) -> MemoryBudget:
    """The decisions when the fully resharded plan (peak ``minimum``) exceeds the budget but
    keeping every bucket that saves time (peak ``peak``) fits: keeping removes the backward's
    re-gather buffers, which can be what made the resharded plan's peak."""
    decisions = list(fixed)
    for c in cands:
        kept = c.saved_s > 0
        reason = (f"kept gathered: the fully resharded plan's peak {minimum / _MiB:.1f} MiB "
                  f"exceeds the budget; keeping every bucket lowers it to {peak / _MiB:.1f} MiB"
                  if kept else "resharded: keeping it would save no predicted time")
        decisions.append(BucketDecision(c.bucket, c.name, kept, c.saved_s * 1e3, c.nbytes,
                                        reason, list(c.params)))
    decisions.sort(key=lambda d: d.bucket)
    return MemoryBudget(budget, minimum, peak, 1, decisions)


def reshard_all(cands: list[Candidate], fixed: list[BucketDecision],
                minimum: int, shallower: int | None = None) -> list[BucketDecision]:
    """The bucket decisions when blocks must be recomputed: the fully resharded plan (peak
    ``minimum``) and the fully kept one both exceed the budget, so no bucket is kept (the
    first lever's choices are dropped before any block is recomputed); ``shallower``: a
    shallower prefetch depth fits instead (``shardc.planning.prefetch``), nothing recomputed."""
    then = (f"prefetching {shallower} bucket(s) ahead instead fits" if shallower is not None
            else "so blocks are recomputed")
    decisions = list(fixed)
    for c in cands:
        decisions.append(BucketDecision(
            c.bucket, c.name, False, c.saved_s * 1e3, c.nbytes,
            f"resharded: even the fully resharded plan's peak {minimum / _MiB:.1f} MiB exceeds "
            f"the budget, {then} and no bucket is kept gathered", list(c.params)))
    decisions.sort(key=lambda d: d.bucket)
    return decisions


def resolve_budget(value: int | str, device) -> int:
    """Bytes of a ``peak_memory_budget_bytes`` value on ``device`` (a ``torch.device``):
    ``"auto"`` is the CUDA device's capacity less a margin; elsewhere it is an error. The
    capacity is what this process may allocate: the device's memory times the caching
    allocator's ``torch.cuda.set_per_process_memory_fraction`` (1 unless the user set it), so
    a process capped to part of a GPU plans for that part, not for the whole device."""
    if value != "auto":
        return int(value)
    import torch

    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        raise MemoryBudgetError(
            f"shardc: peak_memory_budget_bytes='auto' needs a CUDA device, whose capacity is "
            f"known; the parameters are on {device}. Pass a number of bytes instead.")
    total = int(torch.cuda.get_device_properties(device).total_memory
                * torch.cuda.get_per_process_memory_fraction(device))
    advice = fragmentation_advice(_torch.cuda_allocator_settings())
    if advice:
        warnings.warn(advice, stacklevel=2)
    return auto_budget(total)


def auto_budget(capacity_bytes: float) -> int:
    """The ``"auto"`` budget of a device with ``capacity_bytes``: the capacity less a margin for
    what the caching allocator keeps reserved above the allocated peak (fragmentation), the
    larger of :data:`AUTO_MARGIN_FRACTION` of it and :data:`AUTO_MARGIN_MIN_BYTES`. The planning
    CLI resolves ``--memory-budget auto`` with it for a device it has no handle on."""
    total = int(capacity_bytes)
    return int(total - max(AUTO_MARGIN_MIN_BYTES, AUTO_MARGIN_FRACTION * total))


def expandable_segments_on(settings: str) -> bool:
    """Whether an allocator settings string (``PYTORCH_CUDA_ALLOC_CONF``'s syntax) turns on
    expandable segments."""
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def fragmentation_advice(settings: str) -> str | None:
    """What ``"auto"`` tells a user whose caching allocator does not expand segments (None when it
    does). The budget bounds the bytes allocated; without expandable segments a step of large
    tensors can leave tens of GiB reserved but unusable (measured on one H200: batch 320 of the
    1b config ran out of memory asking 39 GiB with 69 GiB allocated and 38 GiB reserved free;
    docs/memory_budget.md), more than the margin allows for."""
    if expandable_segments_on(settings):
        return None
    return ("shardc: peak_memory_budget_bytes='auto' plans the step's allocated bytes up to the "
            "device's capacity, but the CUDA caching allocator runs without expandable segments, "
            "so large tensors can fragment its pool and a step planned to fit can still run out "
            "of memory. Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA "
            "initializes (torchtitan does), or pass a smaller budget in bytes.")
