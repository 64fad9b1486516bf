"""The peak-budget search: which configuration of one region the pipeline builds under
``peak_memory_budget_bytes`` (``docs/memory_budget.md``).

:func:`choose_under_budget` decides, for one training region, which buckets stay gathered from
the forward to the backward (``shardc.planning.budget``), which blocks are recomputed in the
backward or have their saved activations offloaded to the host (``shardc.planning.recompute``,
``shardc.planning.offload``), the prefetch depth (``shardc.planning.prefetch``) and, last,
whether the optimizer's state and step go to the host (``shardc.planning.optimizer_offload``).
It only decides: each configuration it tries is built and predicted by
:attr:`SearchInputs.trial`, which the pipeline makes
(:func:`shardc.compile.pipeline.search_inputs`: the pipeline's steps on a copy of the joint
graph, the pool on the meta device), and the pipeline then builds the chosen one for real. This
module does not import the pipeline.

Every figure a decision compares is the largest over the ranks of the region's group, exchanged
through the group's store (``shardc.runtime.plan_check.agree_on_largest``; each tag once per
region, in the same order on every rank), so every rank makes the same decisions.

The host's memory is a constraint of the search (``region.host_capacity``, agreed across the
ranks before it: ``shardc.compile.host_memory.agree_capacity``): a block's activations or
checkpoint are offloaded, and the optimizer's share put on the host, only while the predicted
host bytes per rank fit it (:class:`HostRoom`); a block that does not fit is recomputed instead
(its decision says "host full: ..."), and where even the optimizer's smallest share does not
fit, no plan fits both memories and the budget is refused (:class:`HostFullError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import fx

from shardc.compile import host_memory
from shardc.compile.host_memory import HostCapacity
from shardc.compile.options import ShardcOptions
from shardc.memory.host import optimizer_host_bytes
from shardc.memory.peak import shard_bytes_by_param
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.fx_utils import is_call, tensor_nbytes
from shardc.passes.host_resident import compute_device_type
from shardc.passes.recompute import Block, checkpoint_bytes
from shardc.planning import (
    budget,
    optimizer_chunks,
    optimizer_kind,
    optimizer_offload,
    prefetch,
    recompute,
    trade,
)
from shardc.planning import offload as offload_lever
from shardc.planning.estimate import elided_cast_seconds
from shardc.planning.plan import (
    BucketDecision,
    MemoryBudget,
    OptimizerChunksDecision,
    Plan,
    PrefetchDecision,
    PrefetchTrial,
    is_part,
    part_name,
    split_part,
)
from shardc.planning.profile import HostLink, resolve_profile
from shardc.planning.schedule import device_name
from shardc.runtime.plan_check import agree_on_largest, agree_on_largest_each

log = logging.getLogger("shardc")


class SearchRegion(Protocol):
    """What the search reads of the region (``shardc.compile.pipeline.RegionRecord``), and the
    one field it sets."""

    index: int  # the region's number, in the log lines
    check_index: int | None  # its number in the cross-rank exchanges' keys
    # Whether the optimizer's state is on the host: read (OffloadPolicy, or an earlier region),
    # and set while the search tries it there (the trials then predict without it) and when it
    # decides it.
    optimizer_on_host: bool
    # The parameters whose state is on the host where only some's is (partial offload): read
    # (an earlier region's choice), and set while the search tries a subset and when it
    # chooses one.
    optimizer_host_params: frozenset[str]
    # Whether the optimizer steps in chunks (shardc.planning.optimizer_chunks): read ("always"),
    # and set while the search tries it and when it decides it.
    optimizer_step_chunks: bool
    # The host memory the plan may fill, the same on every rank (None: no limit; read only,
    # agreed before the search by the pipeline: shardc.compile.host_memory.agree_capacity).
    host_capacity: HostCapacity | None


# Fits of the host-side levers to the host verified per lever (the fit by estimates, one
# refit to the verified excess, the last with no room): bounded work, whatever the model.
MAX_HOST_FITS = 3
# Prefixes of the ranking shorter than every candidate verified where every candidate freed is
# over the budget (shorter_prefixes): bounded work, whatever the model.
MAX_SHORTER = 2


class HostFullError(budget.MemoryBudgetError):
    """No configuration fits both the device budget and the host's memory: the levers the
    device budget needs put more on the host than it has (``minimum_bytes`` None: not a budget
    below the device minimum; every rank raises it alike, the figures being agreed)."""


@dataclass(frozen=True)
class HostRoom:
    """The host memory left to the activation levers of one search (``choose_device_levers``):
    the agreed ``capacity`` less ``base_bytes``, the host bytes of its configuration without
    them (CPU offload's state, the optimizer's share on the host; the largest over the
    ranks)."""

    capacity: HostCapacity
    base_bytes: int
    group: str
    index: int | None
    tag_prefix: str

    @property
    def room(self) -> int:
        """Bytes per rank the activation levers may still put on the host."""
        return max(self.capacity.per_rank - self.base_bytes, 0)

    def used(self, plan: Plan, tag: str) -> int:
        """``plan``'s predicted host bytes per rank, the largest over the ranks (one store
        exchange under ``tag``: once per region)."""
        return agree_on_largest(self.group, self.index, f"{self.tag_prefix}host/{tag}",
                                int(plan.predicted.host_bytes or 0))


@dataclass(frozen=True)
class SearchInputs:
    """What the search needs of one region's joint graph, built by the pipeline
    (:func:`shardc.compile.pipeline.search_inputs`)."""

    # A copy of the region's joint graph before the joint passes; the search only reads it.
    joint: fx.GraphModule
    # One configuration, built on a copy of ``joint`` and planned, lowered and predicted (its
    # pool on the meta device): (parameters kept gathered, blocks recomputed, blocks whose
    # saved activations are offloaded, prefetch depth) -> its plan, as this rank predicts it.
    trial: Callable[[Collection[str], Collection[str], Collection[str], int], Plan]
    # The joint graph after the joint passes (a copy), and the blocks found on it: what the
    # search may recompute or offload.
    probe: fx.GraphModule
    blocks: list[Block]
    # (parameters kept gathered, blocks recomputed, blocks offloaded) -> the partition a trial
    # made of that configuration, handed over once for the real build (None: none made), so
    # the chosen configuration is not partitioned again; the pipeline's business (the search
    # never calls it).
    take_partition: Callable[[Collection[str], Collection[str], Collection[str]],
                             tuple | None] = lambda kept, recomputed, offloaded: None


def kept_params(decided: MemoryBudget) -> set[str]:
    """The parameters the decisions keep gathered from the forward to the backward."""
    return {p for d in decided.decisions if d.kept for p in d.params}


def choose_under_budget(inputs: SearchInputs, options: ShardcOptions,
                        region: SearchRegion) -> MemoryBudget:
    """The budget planner's decisions for one region's joint graph (``inputs``): the levers
    on the device (:func:`choose_device_levers`); where the optimizer step's peak puts them
    over the budget, the optimizer step in chunks (``shardc.planning.optimizer_chunks``), the
    device levers chosen again with it; where that is over the budget too (or their feasible
    minimum is not the step's), the last one: the optimizer's state on the host, with the
    device levers chosen again under it (``shardc.planning.optimizer_offload``), one call over
    every parameter. Refused, naming the minimum (with the chunks, where they were tried and
    the offload is unavailable), where even that is over the budget."""
    unavailable = ("the optimizer's state is on the host already" if region.optimizer_on_host
                   else _optimizer_offload_unavailable(inputs.joint, options))
    chunks_why = _chunks_unavailable(options, region)
    # The step in chunks is tried (before the optimizer's offload) where it is available and
    # not already on ("always": the region starts with it).
    try_chunks = not chunks_why and not region.optimizer_step_chunks
    bases: list[Plan] = []
    first_refusal = None
    try:
        decided = choose_device_levers(inputs, options, region,
                                       step_floor_exits=not unavailable or try_chunks,
                                       on_base=bases.append)
        if region.optimizer_step_chunks:  # "always"
            decided.optimizer_chunks = _chunks_decision(inputs, options, region, bases[-1],
                                                        decided, 0, True, "")
        return decided
    except optimizer_offload.StepOverBudget as over:
        floor, floor_plan, exact = over.floor_bytes, over.plan, False
    except budget.MemoryBudgetError as refused:
        floor = getattr(refused, "minimum_bytes", None)
        if floor is None:  # not a budget below the minimum ("auto" off CUDA)
            raise
        floor_plan, exact = refused.plan, True
        if try_chunks and _agreed_in_step(floor_plan, region):
            first_refusal = refused  # the step in chunks may lower it: tried below
        elif region.optimizer_on_host:  # already there (OffloadPolicy, or an earlier region)
            raise _refusal(refused, optimizer_offload.refusal_hint(True, "")) from None
        elif unavailable:
            log.info("shardc: region %d: optimizer offload not tried: %s", region.index,
                     unavailable)
            raise _refusal(refused, optimizer_offload.refusal_hint(False, unavailable)) from None
    # Never with the optimizer's offload ("always" included: over the budget, it gives way).
    region.optimizer_step_chunks = False
    if try_chunks:
        chunked = _try_chunks(inputs, options, region, floor_plan, floor, exact, unavailable)
        if chunked is not None:
            return chunked
    if unavailable:  # the chunks could not meet the budget, and nothing else is left
        if first_refusal is not None:
            raise _refusal(first_refusal, optimizer_offload.refusal_hint(
                region.optimizer_on_host, unavailable)) from None
        return _refuse_without_offload(inputs, options, region, unavailable)
    try:
        subset = _host_subset(inputs, options, region, floor_plan, floor, exact)
    except HostFullError as full:
        raise _host_refusal(full, floor, exact) from None
    if subset.decided is not None:
        decided = subset.decided
        decided.optimizer = _optimizer_decision(floor_plan, floor, exact, decided, options,
                                                region, device_name(inputs.joint), subset,
                                                shard_bytes_by_param(inputs.joint))
        log.warning("shardc: region %d: the peak budget puts part of the optimizer's state and "
                    "step on the host (optimizer_offload='never' turns this off): %s",
                    region.index, decided.optimizer.reason)
        return decided
    region.optimizer_on_host = True  # every prediction below leaves the state to the host
    try:
        decided = choose_device_levers(inputs, options, region, tag_prefix="host/",
                                       optimizer_lever=True)
    except budget.MemoryBudgetError as again:
        region.optimizer_on_host = False
        if isinstance(again, HostFullError):
            raise _host_refusal(again, floor, exact) from None
        if getattr(again, "minimum_bytes", None) is None:
            raise
        raise _refusal(again, optimizer_offload.refusal_hint(True, "", floor, exact)) from None
    decided.optimizer = _optimizer_decision(floor_plan, floor, exact, decided, options, region,
                                            device_name(inputs.joint), subset,
                                            shard_bytes_by_param(inputs.joint))
    # A warning: the host step costs far more than any device lever (seconds per step at 1e9
    # parameters); the user may prefer a larger budget or more ranks.
    log.warning("shardc: region %d: the peak budget puts the optimizer's state and step on the "
                "host (optimizer_offload='never' turns this off): %s", region.index,
                decided.optimizer.reason)
    return decided


def _chunks_unavailable(options: ShardcOptions, region: SearchRegion) -> str:
    """Why the optimizer step in chunks cannot be tried for this region ("" where it can;
    whether the buckets make two chunks is checked on the plan)."""
    return optimizer_chunks.why_not(options.optimizer_step_chunks, options.optimizer_impl,
                                    options.optimizer_temp_factor, region.optimizer_on_host,
                                    region.optimizer_host_params, n_chunks=2)


def _agreed_in_step(plan: Plan | None, region: SearchRegion) -> bool:
    """Whether the peak of ``plan`` is in the optimizer step's column on any rank (one store
    exchange: every rank decides alike)."""
    group = plan.group_name if plan is not None else ""
    return bool(agree_on_largest(group, region.check_index, "chunks/in_step",
                                 int(_peak_in_step(plan))))


def _try_chunks(inputs: SearchInputs, options: ShardcOptions, region: SearchRegion,
                floor_plan: Plan, floor: int, exact: bool, unavailable: str
                ) -> MemoryBudget | None:
    """The device levers chosen again with the optimizer step in chunks
    (``shardc.planning.optimizer_chunks``), where the step with one call is over the budget
    (``floor``, of ``floor_plan``; not ``exact``: the step's peak): their decisions, with the
    chunks' record, or None where that is over the budget too (the region's flag put back;
    where the optimizer's offload is ``unavailable`` the refusal is raised here, naming the
    minimum with the chunks)."""
    parts = optimizer_chunks.chunks(floor_plan.buckets, shard_bytes_by_param(inputs.joint))
    if len(parts) < 2:
        log.info("shardc: region %d: optimizer step in chunks not tried: one chunk",
                 region.index)
        return None
    region.optimizer_step_chunks = True
    bases: list[Plan] = []
    try:
        decided = choose_device_levers(inputs, options, region, tag_prefix="chunks/",
                                       step_floor_exits=not unavailable, on_base=bases.append)
    except optimizer_offload.StepOverBudget as over:
        region.optimizer_step_chunks = False
        log.info("shardc: region %d: optimizer step in chunks tried, its step is over the "
                 "budget too (%d B)", region.index, over.floor_bytes)
        return None
    except budget.MemoryBudgetError as refused:
        region.optimizer_step_chunks = False
        log.info("shardc: region %d: optimizer step in chunks tried, over the budget: %s",
                 region.index, refused)
        if getattr(refused, "minimum_bytes", None) is None:
            raise
        if not unavailable:
            return None
        log.info("shardc: region %d: optimizer offload not tried: %s", region.index,
                 unavailable)
        raise _refusal(refused, optimizer_offload.refusal_hint(
            region.optimizer_on_host, unavailable)) from None
    decided.optimizer_chunks = _chunks_decision(inputs, options, region, bases[0], decided,
                                                floor, exact, "chunks/")
    log.warning("shardc: region %d: the peak budget steps the optimizer in chunks "
                "(optimizer_step_chunks='never' turns this off): %s", region.index,
                decided.optimizer_chunks.reason)
    return decided


def _chunks_decision(inputs: SearchInputs, options: ShardcOptions, region: SearchRegion,
                     base: Plan, decided: MemoryBudget, floor: int, exact: bool,
                     tag_prefix: str) -> OptimizerChunksDecision:
    """The record of the step in chunks, from the chunked search's first plan (``base``);
    every number the largest over the ranks."""
    group, index = base.group_name, region.check_index
    p = base.predicted
    chunk = int(p.optimizer_chunk_bytes or 0)
    stepped = int((p.param_bytes or 0) - (p.optimizer_host_param_bytes or 0))
    saved = max(stepped - chunk, 0) * options.optimizer_temp_factor
    chunk = agree_on_largest(group, index, f"{tag_prefix}chunks/bytes", chunk)
    saved = agree_on_largest(group, index, f"{tag_prefix}chunks/saved", int(saved))
    n = len(optimizer_chunks.chunks(base.buckets, shard_bytes_by_param(inputs.joint)))
    profile = resolve_profile(options.cluster, device_name(inputs.joint))
    seconds = optimizer_chunks.price(n, profile, options.optimizer_state_factor,
                                     options.optimizer_temp_factor)
    return optimizer_chunks.decision(n_chunks=n, chunk_bytes=chunk, saved_bytes=saved,
                                     seconds=seconds, peak_bytes=decided.peak_bytes,
                                     floor_bytes=floor, exact=exact,
                                     mode=options.optimizer_step_chunks)


def _refuse_without_offload(inputs: SearchInputs, options: ShardcOptions, region: SearchRegion,
                            unavailable: str) -> MemoryBudget:
    """The device levers' full search with one optimizer call, where the step's floor exited
    early for the chunks that then could not meet the budget and the optimizer's offload is
    ``unavailable``: their refusal, naming their minimum (or, should they meet it after all,
    their decisions)."""
    try:
        return choose_device_levers(inputs, options, region, tag_prefix="full/")
    except budget.MemoryBudgetError as refused:
        if getattr(refused, "minimum_bytes", None) is None:
            raise
        raise _refusal(refused, optimizer_offload.refusal_hint(
            region.optimizer_on_host, unavailable)) from None


def _host_refusal(full: HostFullError, floor: int, exact: bool) -> HostFullError:
    """The refusal where the optimizer's share the device budget needs does not fit the host:
    ``full``'s figures (what the host would need, what it has) after the device levers'
    minimum (``floor``; not ``exact``: the optimizer step's peak, a lower bound)."""
    return HostFullError(
        f"shardc: no plan fits both the peak budget and the host's memory: the device levers "
        f"alone reach {'' if exact else 'at least '}{floor} B ({floor / 2**20:.1f} MiB), over "
        f"the budget, and {full} Raise peak_memory_budget_bytes, run fewer ranks per host or "
        "free host memory (optimizer_offload='never' refuses such a budget at once); "
        "check_host_memory=False skips this check.")


@dataclass
class HostSubset:
    """The partial choice of the optimizer's offload: ``decided`` the device levers' decisions
    with the state of ``chosen`` (the first buckets of ``order``) on the host, or None where no
    subset tried met the budget (``tried`` of them; every parameter's state goes then)."""

    order: list[optimizer_offload.HostUnit]
    chosen: list[optimizer_offload.HostUnit]
    decided: MemoryBudget | None
    tried: int


def _host_subset(inputs: SearchInputs, options: ShardcOptions, region: SearchRegion,
                 floor_plan: Plan, floor: int, exact: bool) -> HostSubset:
    """The fewest buckets (largest state first: ``optimizer_offload.units``) whose optimizer
    state and step on the host bring the predicted peak within the budget, the device levers
    chosen again under each subset tried (at most ``optimizer_offload.MAX_SUBSET_TRIALS``).
    The first subset covers the floor's excess over the budget (``floor``: the device levers'
    feasible minimum, or not ``exact``, the optimizer step's peak); a subset whose search is
    refused is grown to cover that search's minimum's excess. Every figure is the largest over
    the ranks (the buckets' sizes in one store exchange), so every rank tries and chooses the
    same subsets."""
    group, index = floor_plan.group_name, region.check_index
    local = shard_bytes_by_param(inputs.joint)
    base = region.optimizer_host_params

    # Every bucket's bytes in one store exchange: the buckets units() asks about, found by a
    # first pass over this rank's bytes (the same buckets on every rank: the plans' buckets
    # and ``base`` are), then their largest over the ranks in that order.
    asked: list[int] = []

    def local_bytes(bucket: int, params: tuple[str, ...]) -> int:
        asked.append(sum(local.get(p, 0) for p in params))
        return asked[-1]

    optimizer_offload.units(floor_plan, local_bytes, base)
    largest = iter(agree_on_largest_each(group, index, "optimizer/buckets", asked))
    order = optimizer_offload.units(floor_plan, lambda bucket, params: next(largest), base)
    target = budget.planned_for(budget.resolve_budget(options.peak_memory_budget_bytes,
                                                      gather_device(inputs.joint)),
                                options.peak_memory_margin)
    state, per_byte, one_off = _freed_by_host_state(
        options, floor_plan, optimizer_kind.per_tensor_temp_bytes(
            local.values(), options.optimizer_state_factor))
    one_off = agree_on_largest(group, index, "optimizer/temps_freed", one_off)  # same subsets
    count = optimizer_offload.take(order, 0, floor - target - (
        one_off if not exact or _peak_in_step(floor_plan) else 0),
                                   state + per_byte if not exact or _peak_in_step(floor_plan)
                                   else state)
    tried = 0
    while tried < optimizer_offload.MAX_SUBSET_TRIALS and count < len(order):
        chosen = order[:count]
        region.optimizer_host_params = base | {p for u in chosen for p in u.params}
        tried += 1
        try:
            decided = choose_device_levers(inputs, options, region, tag_prefix=f"host{tried}/",
                                           step_floor_exits=True, optimizer_lever=True)
            return HostSubset(order, chosen, decided, tried)
        except optimizer_offload.StepOverBudget as over:
            again, in_step = over.floor_bytes, True
        except budget.MemoryBudgetError as refused:
            if getattr(refused, "minimum_bytes", None) is None:
                region.optimizer_host_params = base
                raise
            again, in_step = refused.minimum_bytes, _peak_in_step(refused.plan)
        count = optimizer_offload.take(order, count, again - target,
                                       state + per_byte if in_step else state)
    region.optimizer_host_params = base
    return HostSubset(order, order, None, tried)


def _freed_by_host_state(options: ShardcOptions, plan: Plan, per_tensor: int
                         ) -> tuple[float, float, int]:
    """What a shard byte's optimizer state on the host frees in the optimizer step's column:
    (its state's bytes per byte, its temporaries' per byte, bytes freed at once by the first
    shard that goes). The step's temporaries follow the implementation that runs on the group
    once it holds host tensors (``shardc.planning.optimizer_kind``): foreach's shrink with the
    device part; ``"auto"``'s switch to the per-tensor loop frees ``plan``'s foreach
    temporaries at once, less the per-tensor ones of the shards left (``per_tensor``:
    ``optimizer_kind.per_tensor_temp_bytes`` over them; an estimate where they are not known
    yet: each subset is verified)."""
    state, temp = options.optimizer_state_factor, options.optimizer_temp_factor
    after = optimizer_kind.ran(options.optimizer_impl, temp, host_in_group=True)
    if after == "foreach":
        return state, temp, 0
    before = optimizer_kind.ran(options.optimizer_impl, temp,
                                host_in_group=bool(plan.predicted.optimizer_host_param_bytes))
    if before != "foreach":
        return state, 0.0, 0
    temps = int(plan.predicted.optimizer_temp_bytes or 0)
    left = optimizer_kind.step_temp_bytes(after, plan.predicted.param_bytes or 0.0, per_tensor,
                                          temp)
    return state, 0.0, max(temps - left, 0)


def _peak_in_step(plan: Plan | None) -> bool:
    """Whether ``plan``'s predicted peak is in the optimizer step's column (where a byte of
    state on the host frees its step temporaries too)."""
    peak = (plan.memory_by_category.get("peak") or {}) if plan is not None else {}
    return peak.get("graph") == "optimizer step"


def _refusal(refused: budget.MemoryBudgetError, hint: str) -> budget.MemoryBudgetError:
    """``refused`` with ``hint`` (on the optimizer's offload) added to its text, carrying its
    figures (the minimum, the fully resharded plan's peaks, the minimum's plan)."""
    error = budget.MemoryBudgetError(str(refused) + hint)
    for name in ("minimum_bytes", "resharded_bytes", "resharded_by_depth", "plan"):
        if getattr(refused, name, None) is not None:
            setattr(error, name, getattr(refused, name))
    return error


def _optimizer_offload_unavailable(gm: fx.GraphModule, options: ShardcOptions) -> str:
    """Why the optimizer's state cannot go to the host for this region ("" where it can)."""
    from shardc.sharding.shard import state_for_key

    gathers = [GatherArgs.of(n) for n in gm.graph.nodes if is_call(n, GATHER_OP)]
    state = state_for_key(gathers[0].sync_key) if gathers else None
    if state is None:
        return "the sharded model's state is gone"
    fp8 = state.fp8 is not None or any(i.quantized or i.fp8 is not None
                                       for i in state.params.values())
    tp = state.layout is not None and state.layout.kind == "fsdp+tp"
    return optimizer_offload.why_not(options.optimizer_offload, state.mesh.device_type,
                                     state.offload, fp8, tp)


def _optimizer_decision(floor_plan: Plan, floor: int, exact: bool, decided: MemoryBudget,
                        options: ShardcOptions, region: SearchRegion, device: str | None,
                        subset: HostSubset, local: dict[str, int]):
    """The record of the optimizer's state put on the host (of the buckets ``subset`` chose,
    or where it chose none, of every parameter), priced from the device levers' floor plan
    (``floor_plan``, peak ``floor``; not ``exact``: ``floor`` is the optimizer step's peak,
    under every configuration's); every number the largest over the ranks."""
    group, index = floor_plan.group_name, region.check_index

    def largest(tag: str, value: float) -> int:
        return agree_on_largest(group, index, f"optimizer/{tag}", int(value or 0))

    p = floor_plan.predicted
    param_bytes = largest("param_bytes", p.param_bytes)
    grad_bytes = largest("grad_bytes", p.grad_bytes)
    n_params = largest("numel", _shard_numel(floor_plan))
    chosen = subset.chosen if subset.decided is not None else None
    if chosen is not None:  # the chosen buckets' shards, and their gradients in proportion
        host_param_bytes = sum(u.nbytes for u in chosen)
        grad_bytes = grad_bytes * host_param_bytes // max(param_bytes, 1)
        param_bytes, n_params = host_param_bytes, sum(u.numel for u in chosen)
    host_names = {p for u in chosen for p in u.params} if chosen is not None else set(local)
    state, per_byte, one_off = _freed_by_host_state(
        options, floor_plan, optimizer_kind.per_tensor_temp_bytes(
            (None if fqn in host_names else n for fqn, n in local.items()),
            options.optimizer_state_factor))
    if chosen is None:  # every parameter's: the state and all the step's temporaries
        temps = floor_plan.predicted.optimizer_temp_bytes
        if temps is None:
            temps = param_bytes * options.optimizer_temp_factor
        freed = int(param_bytes * state) + largest("temps", temps)
    else:
        freed = int(param_bytes * (state + per_byte)) + largest("temps_left", one_off)
    profile = resolve_profile(options.cluster, device)
    return optimizer_offload.decision(
        freed_bytes=freed, host_bytes=optimizer_host_bytes(param_bytes,
                                                           options.optimizer_state_factor),
        n_params=n_params, param_bytes=param_bytes, grad_bytes=grad_bytes, profile=profile,
        floor_bytes=floor, peak_bytes=decided.peak_bytes, exact=exact, chosen=chosen,
        of=len(subset.order), tried=subset.tried,
        ran=optimizer_kind.ran(options.optimizer_impl, options.optimizer_temp_factor,
                               host_in_group=True))


def _shard_numel(plan: Plan) -> int:
    """Elements of a rank's parameter shards, padding included (the largest rank's)."""
    seen, total = set(), 0
    for b in plan.buckets:
        for fqn, rows, row_numel in zip(b.params, b.padded_rows, b.row_numel):
            if fqn not in seen:
                seen.add(fqn)
                total += rows * row_numel
    return total


def choose_device_levers(inputs: SearchInputs, options: ShardcOptions, region: SearchRegion,
                         tag_prefix: str = "", step_floor_exits: bool = False,
                         optimizer_lever: bool = False,
                         on_base: Callable[[Plan], None] | None = None) -> MemoryBudget:
    """The decisions of the levers on the device for one region's joint graph (``inputs``,
    each configuration built by ``inputs.trial``): the fully resharded configuration first;
    within the budget, the greedy keeps buckets gathered; over it, every bucket kept is tried
    once, then blocks are recomputed or their activations offloaded (:func:`_free_at_some_depth`;
    refused where no configuration tried there fits, naming the lowest peak tried); a shallower
    prefetch depth is tried before those, and the chosen configuration's depth is decided last
    (:func:`_choose_prefetch`). ``tag_prefix``: of
    the cross-rank exchanges' tags (each tag once per region), for a second search under other
    conditions (the optimizer's state on the host). ``step_floor_exits``: raise
    :class:`optimizer_offload.StepOverBudget` as soon as the optimizer step's peak alone is over
    the budget (the caller then puts the state on the host). ``optimizer_lever``: the search
    put (part of) the optimizer's state on the host for this one: raise
    :class:`HostFullError` where that alone is over the host's capacity
    (``region.host_capacity``); the activation levers are fitted to what is left
    (:class:`HostRoom`). ``on_base``: called with the fully resharded configuration's plan,
    the search's first (the optimizer step's figures are the same in every configuration)."""
    user_bytes = budget.resolve_budget(options.peak_memory_budget_bytes,
                                       gather_device(inputs.joint))
    margin = options.peak_memory_margin
    # Every decision is made against the budget less the margin for the prediction's error;
    # the record names both (budget.with_margin).
    budget_bytes = budget.planned_for(user_bytes, margin)
    trials: list[str] = []

    default_depth = depth_of(options)
    evaluated: dict[tuple, tuple[Plan, int, int]] = {}  # configuration -> plan, peak, step ns

    def evaluate(kept: set[str], recomputed: frozenset[str] = frozenset(),
                 offloaded: frozenset[str] = frozenset(), depth: int | None = None
                 ) -> tuple[Plan, int]:
        key = (frozenset(kept), frozenset(recomputed), frozenset(offloaded),
               default_depth if depth is None else depth)
        if key not in evaluated:
            evaluated[key] = _evaluate(kept, recomputed, offloaded, key[3])
        return evaluated[key][:2]

    def _evaluate(kept: set[str], recomputed: frozenset[str], offloaded: frozenset[str],
                  depth: int) -> tuple[Plan, int, int]:
        plan = inputs.trial(kept, recomputed, offloaded, depth)
        # Every rank compares the ranks' largest peak (and step time): the same decisions
        # everywhere.
        tag = f"{tag_prefix}trial{len(trials)}"
        trials.append(tag)
        peak = agree_on_largest(plan.group_name, region.check_index, tag,
                                int(plan.predicted.peak_bytes or 0))
        step_ns = agree_on_largest(plan.group_name, region.check_index, f"{tag}/ns",
                                   int((plan.predicted.step_time_s or 0.0) * 1e9))
        return plan, peak, step_ns

    def depth_trial(kept: set[str], recomputed, offloaded, depth: int) -> PrefetchTrial:
        evaluate(kept, recomputed, offloaded, depth)
        _, peak, step_ns = evaluated[(frozenset(kept), frozenset(recomputed),
                                      frozenset(offloaded), depth)]
        return PrefetchTrial(depth, step_ns * 1e-6, peak, peak <= budget_bytes)

    base, minimum = evaluate(set())
    if on_base is not None:
        on_base(base)
    host = _host_room(base, region, tag_prefix, optimizer_lever)
    if step_floor_exits:
        # The optimizer step's shards, gradients, state and temporaries are the same in every
        # configuration of these levers: over the budget, none can meet it.
        # (The state of the shards whose optimizer a partial offload put on the host is not.)
        step = base.predicted
        shards = step.param_bytes or 0
        stepped_here = shards - (step.optimizer_host_param_bytes or 0)
        temps = step.optimizer_temp_bytes  # as the implementation that runs holds them
        if temps is None:
            temps = stepped_here * options.optimizer_temp_factor
        floor = agree_on_largest(base.group_name, region.check_index, f"{tag_prefix}step",
                                 int(shards + stepped_here * options.optimizer_state_factor
                                     + temps + (step.grad_bytes or 0)))
        if floor > budget_bytes:
            raise optimizer_offload.StepOverBudget(floor, base)
    probe, blocks = inputs.probe, inputs.blocks  # the joint passes' graph and its blocks
    cands, fixed = budget.candidates(base, elided_cast_seconds(
        inputs.joint, resolve_profile(options.cluster, device_name(inputs.joint))))
    params = {c.bucket: set(c.params) for c in cands}
    useful = {p for c in cands if c.saved_s > 0 for p in c.params}
    shallow, current = None, default_depth  # the depth the chosen configuration is found at
    if minimum <= budget_bytes:
        decided = budget.choose(
            cands, fixed, budget_bytes, minimum,
            lambda kept: evaluate(set().union(*(params[b] for b in kept)))[1])
        decided.blocks = recompute.decisions(blocks, [], [], needed=False)
    else:
        kept_plan, peak = evaluate(useful) if useful else (base, minimum)
        if peak > budget_bytes and _prefetches(base):
            shallow = _shallower_fit(lambda d: depth_trial(set(), (), (), d), default_depth)
        if peak <= budget_bytes:
            decided = budget.keep_all(cands, fixed, budget_bytes, minimum, peak)
            decided.blocks = recompute.decisions(blocks, [], [], needed=False)
        elif shallow is not None:  # prefetching less fits: no block recomputed or offloaded
            current = shallow.depth
            decided = MemoryBudget(budget_bytes, minimum, shallow.peak_bytes, 0, [],
                                   recompute.decisions(blocks, [], [], needed=False))
            decided.decisions = budget.reshard_all(cands, fixed, minimum, shallow.depth)
        else:
            lowest = (base, minimum) if minimum <= peak else (kept_plan, peak)
            for key, (plan_d, peak_d, _) in evaluated.items():  # the shallower depths tried
                if not any(key[:3]) and peak_d < lowest[1]:
                    lowest = (plan_d, peak_d)
            # Memory is short: blocks are freed at the shallowest depth tried, then at the
            # deeper ones where that is refused (_free_at_some_depth; one deeper is tried on
            # the result, below).
            depths = sorted({k[3] for k in evaluated if not any(k[:3])})

            def free_at(depth: int, give_up_at: int | None) -> MemoryBudget:
                # A deeper depth's exchanges under their own tags (each tag once per region).
                prefix = tag_prefix if depth == depths[0] else f"{tag_prefix}depth{depth}/"
                return _recompute_under_budget(
                    probe, blocks, user_bytes, evaluate(set(), depth=depth), lowest, options,
                    region, lambda recomputed, offloaded: evaluate(set(), recomputed, offloaded,
                                                                   depth),
                    tag_prefix=prefix, host=host if host is None or depth == depths[0]
                    else replace(host, tag_prefix=f"{host.tag_prefix}depth{depth}/"),
                    give_up_at=give_up_at)

            try:
                decided, current = _free_at_some_depth(free_at, depths)
            except budget.MemoryBudgetError as exc:
                # The fully resharded plan's peak at the options' depth (the fixed policy's)
                # and at each depth tried (the ranks' largest).
                exc.resharded_bytes = minimum
                exc.resharded_by_depth = {k[3]: v[1] for k, v in evaluated.items()
                                          if not any(k[:3])}
                raise
            decided.decisions = budget.reshard_all(cands, fixed, minimum)

    def peak_and_step(kept: frozenset[str], recomputed: frozenset[str]) -> tuple[int, float]:
        evaluate(set(kept), recomputed, frozenset(), current)
        _, peak, step_ns = evaluated[(kept, recomputed, frozenset(), current)]
        return peak, step_ns * 1e-9

    traded = _trade_levers(decided, cands, fixed, probe, blocks, options, region,
                           base.group_name, budget_bytes, peak_and_step, tag_prefix)
    if traded is not None:
        decided = traded
    decided.prefetch = _choose_prefetch(
        lambda d: depth_trial(kept_params(decided), decided.recomputed,
                              decided.offloaded + decided.checkpoint_offloaded, d),
        base, default_depth, budget_bytes, current)
    decided.peak_bytes = decided.prefetch.peak_bytes
    decided.trials = len(evaluated) - 1
    budget.with_margin(decided, user_bytes, margin)
    if host is not None and any("host full" in d.reason for d in decided.blocks):
        decided.host = host.capacity.describe()  # why the blocks' reasons say "host full"
    log.info("shardc: region %d, peak budget %d B (planned for %d B): minimum %d B, kept "
             "gathered %s, recomputed %s, offloaded %s, checkpoints offloaded %s, predicted "
             "peak %d B (%d trials)", region.index, user_bytes, budget_bytes,
             decided.minimum_bytes, decided.kept, decided.recomputed, decided.offloaded,
             decided.checkpoint_offloaded, decided.peak_bytes, decided.trials)
    return decided


def _trade_levers(decided: MemoryBudget, cands: list[budget.Candidate],
                  fixed: list[BucketDecision], probe: fx.GraphModule, blocks: list[Block],
                  options: ShardcOptions, region: SearchRegion, group: str, budget_bytes: int,
                  peak_and_step: trade.Evaluate, tag_prefix: str) -> MemoryBudget | None:
    """:func:`shardc.planning.trade.trade_recompute_for_kept` for one region: blocks recomputed
    so that buckets can stay gathered, where that predicts a shorter step. The blocks'
    estimates (agreed over the ranks, under their own exchange tags) are made only where a
    bucket that saves time is not kept and nothing is offloaded whole."""
    if not options.recompute_to_keep_gathered or options.activation_offload != "auto":
        return None
    if decided.offloaded_whole or decided.checkpoint_offloaded or not blocks:
        return None
    # Its candidates are whole blocks: a choice with recomputed parts is left as it is.
    if any(d.recomputed_part for d in decided.blocks):
        return None
    # Where the host took no offload it could have, the blocks' records say why; left as is.
    if any("host full" in d.reason for d in decided.blocks):
        return None
    if not any(c.saved_s > 0 and c.bucket not in decided.kept for c in cands):
        return None
    prefix = f"{tag_prefix}trade/"
    estimates = block_estimates(probe, blocks, group, options, region, prefix)
    link = agreed_link(probe, group, options, region, prefix)
    block_cands = free_candidates(blocks, estimates, "never", link)
    return trade.trade_recompute_for_kept(decided, cands, fixed, blocks, block_cands,
                                          budget_bytes, peak_and_step)


def _host_room(base: Plan, region: SearchRegion, tag_prefix: str,
               optimizer_lever: bool) -> HostRoom | None:
    """The host memory left to this search's activation levers (None: no limit), from the
    fully resharded plan ``base``'s host bytes (the largest over the ranks). Raises
    :class:`HostFullError` where the optimizer's share this search tries (``optimizer_lever``)
    already overfills the host: no configuration of the other levers lowers host bytes."""
    capacity = region.host_capacity
    if capacity is None:
        return None
    base_bytes = agree_on_largest(base.group_name, region.check_index, f"{tag_prefix}host/base",
                                  int(base.predicted.host_bytes or 0))
    if optimizer_lever and not capacity.fits(base_bytes):
        raise HostFullError(f"the optimizer's state on the host needs "
                            f"{host_memory.size(base_bytes)} per rank: "
                            f"{capacity.full(base_bytes)}.")
    return HostRoom(capacity, base_bytes, base.group_name, region.check_index, tag_prefix)


def fit_offloads(cands: list[recompute.RecomputeCandidate], blocks: list[Block],
                 link: HostLink, room: int | None, capacity: HostCapacity | None,
                 committed: int = 0, scale: float = 1.0
                 ) -> tuple[list[recompute.RecomputeCandidate], dict[str, str]]:
    """``cands`` with their offloads limited to ``room`` host bytes per rank (None: no limit),
    a block's host bytes estimated as its saved bytes times ``scale`` (what the verified plans
    measured per estimated byte, :func:`_within_host`). The offloads kept are taken in order
    of value, the blocks that cannot be recomputed first (offload is their only lever), then
    the most step time saved against recomputing per byte (ties by position), each while it
    fits; a block left out is recomputed instead where it can be, else left saved. Returns the
    candidates and, per block left out, why ("host full: would need X, host has Y";
    ``committed``: the bytes per rank on the host before these). Deterministic: every input
    is agreed across the ranks."""
    if room is None or capacity is None:
        return cands, {}
    by_name = {b.name: b for b in blocks}

    def value(c: recompute.RecomputeCandidate) -> tuple:
        can = not by_name[split_part(c.block)[0]].excluded
        return (can, -(c.forward_s - c.offload_s) / max(c.nbytes, 1) if can else 0.0,
                c.position)

    kept, used, notes = set(), 0, {}
    for c in sorted((c for c in cands if c.offload), key=value):
        need = round(c.nbytes * scale)
        if used + need <= room:
            kept.add(c.block)
            used += need
        elif not is_part(c.block):  # a part left out: its block's record says why
            notes[c.block] = capacity.full(committed + used + need)
    out = []
    for c in cands:
        if not c.offload or c.block in kept:
            out.append(c)
            continue
        if is_part(c.block):  # a part the host cannot take stays saved
            continue
        b = by_name[c.block]
        lever = offload_lever.choose_lever(
            forward_s=c.forward_s, recompute_bytes=b.freed_bytes, offload_bytes=0,
            can_recompute=not b.excluded, link=link, mode="never")
        if lever is not None:  # recomputed instead, priced as free_candidates prices it
            out.append(recompute.RecomputeCandidate(
                c.block, c.kind, c.position, lever.cost_s, lever.nbytes, offload=False,
                forward_s=c.forward_s, copy_s=c.copy_s, offload_s=c.offload_s,
                host_note=notes[c.block]))
    return out, notes


def fit_checkpoints(checkpoints: list[recompute.RecomputeCandidate], room: int | None,
                    capacity: HostCapacity | None, committed: int = 0, scale: float = 1.0
                    ) -> tuple[list[recompute.RecomputeCandidate], dict[str, str]]:
    """The checkpoint offloads that fit ``room`` host bytes per rank (None: all of them), each
    estimated as its bytes times ``scale``: the longest prefix of their ranking (the search
    takes a prefix of it, ``recompute.choose``); the others stay on the device, each with why
    (keyed ``"checkpoint:<block>"``; ``committed`` as :func:`fit_offloads`'s)."""
    if room is None or capacity is None:
        return checkpoints, {}
    out, used, notes = [], 0, {}
    for c in recompute.rank(checkpoints):
        need = round(c.nbytes * scale)
        if not notes and used + need <= room:
            out.append(c)
            used += need
        else:
            notes[f"checkpoint:{c.block}"] = capacity.full(committed + used + need)
    return out, notes


def _within_host(host: HostRoom | None, committed: int, fit, build, tag: str):
    """One host lever's candidates fitted to the host, verified: ``fit(room, scale)`` ->
    (candidates, notes) (room None: every candidate), ``build(candidates)`` -> (plan, peak).
    First every candidate, as without a limit: where its plan's host bytes (the largest over
    the ranks) fit, that is the answer (a host with room changes nothing). Otherwise the
    estimates are scaled by what that plan measured per estimated byte (above ``committed``,
    the bytes on the host before these) and fitted to the room left; while a verified plan is
    still over, fitted again to the room less the excess, the last time to no room: at most
    :data:`MAX_HOST_FITS` fits after the first. Returns (candidates, notes, plan, peak)."""
    cands, notes = fit(None, 1.0)
    plan, peak = build(cands)
    if host is None:
        return cands, notes, plan, peak
    used = host.used(plan, f"{tag}0")
    estimated = sum(c.nbytes for c in cands if c.offload)
    if host.capacity.fits(used) or not estimated:
        return cands, notes, plan, peak
    scale = max(used - committed, 1) / estimated
    room = max(host.capacity.per_rank - committed, 0)
    for attempt in range(1, MAX_HOST_FITS + 1):
        room = 0 if attempt == MAX_HOST_FITS else room
        cands, notes = fit(room, scale)
        plan, peak = build(cands)
        if room == 0:
            break
        used = host.used(plan, f"{tag}{attempt}")
        if host.capacity.fits(used):
            break
        room = max(room - (used - host.capacity.per_rank), 0)
    return cands, notes, plan, peak


def depth_of(options: ShardcOptions) -> int:
    """The options' prefetch depth (0: no prefetch)."""
    return options.prefetch_depth if options.prefetch else 0


def with_depth(options: ShardcOptions, depth: int) -> ShardcOptions:
    """``options`` prefetching ``depth`` buckets ahead (0: no prefetch)."""
    if depth == depth_of(options):
        return options
    return replace(options, prefetch=depth > 0, prefetch_depth=max(depth, 1))


def _prefetches(plan: Plan) -> bool:
    """Whether the plan has an all-gather whose issue a prefetch depth moves (not elided)."""
    return any(c.kind == "all_gather" and c.origin == "shardc" and not c.elided
               for c in plan.collectives)


def _shallower_fit(trial, default: int) -> PrefetchTrial | None:
    """The deepest depth below ``default`` at which the fully resharded plan fits (``trial``:
    depth -> its :class:`PrefetchTrial`), or None."""
    for depth in prefetch.shallower_depths(default):
        got = trial(depth)
        if got.fits:
            return got
    return None


def _choose_prefetch(trial, base: Plan, default: int, budget_bytes: int,
                     current: int) -> PrefetchDecision:
    """The prefetch depth of the chosen configuration, found at depth ``current`` (``trial``:
    depth -> its predicted :class:`PrefetchTrial`): :func:`shardc.planning.prefetch.choose_depth`
    over the depths tried (:func:`shardc.planning.prefetch.depths_to_try`); only the options'
    depth where no all-gather is prefetched (one-rank groups)."""
    if not _prefetches(base):
        only = trial(default)
        return PrefetchDecision(default, default, only.step_ms, only.peak_bytes,
                                f"prefetch depth {default} (the options'): no all-gather to "
                                "prefetch (every gather elided: one-rank group)", [only])
    return prefetch.choose_depth([trial(d) for d in prefetch.depths_to_try(current)],
                                 default, budget_bytes)


def _free_at_some_depth(free_at: Callable[[int, int | None], MemoryBudget],
                        depths: list[int]) -> tuple[MemoryBudget, int]:
    """Blocks freed (``free_at(depth, give_up_at)``: :func:`_recompute_under_budget` at that
    prefetch depth) at the shallowest of ``depths`` (ascending: the depths whose fully resharded
    plan was tried, each over the budget) and, where that is refused, at each deeper one in
    turn, searched only where its fully freed plan peaks below the lowest minimum refused so
    far (``give_up_at``: only its fully freed plan is tried where it does not, as fitted to
    the host, with recompute in place of offload once). A deeper depth holds more gathered
    buckets and usually peaks higher, which is why the shallowest goes first; but the schedule
    can put the peak where a deeper one holds less, so a refusal must not name the
    shallowest's minimum where another depth's is lower. Returns the decisions and their
    depth; raises the refusal that names the lowest minimum (the shallowest's on a tie). Every
    comparison is of agreed peaks: every rank searches the same depths."""
    refused: budget.MemoryBudgetError | None = None
    for depth in depths:
        try:
            return free_at(depth, None if refused is None else refused.minimum_bytes), depth
        except budget.MemoryBudgetError as exc:
            if getattr(exc, "minimum_bytes", None) is None:  # not a budget below a minimum
                raise
            if refused is None or exc.minimum_bytes < refused.minimum_bytes:
                refused = exc
    assert refused is not None  # depths holds the options' depth at least
    raise refused


def _recompute_under_budget(probe: fx.GraphModule, blocks: list[Block], user_bytes: int,
                            resharded: tuple[Plan, int], lowest: tuple[Plan, int],
                            options: ShardcOptions, region: SearchRegion,
                            evaluate, tag_prefix: str = "",
                            host: HostRoom | None = None,
                            give_up_at: int | None = None) -> MemoryBudget:
    """The blocks to recompute when no configuration of the first lever fits (``resharded``:
    the fully resharded plan and its peak; ``lowest``: the lower of it and the fully kept
    one); refuses the budget (``user_bytes``, planned for less its margin) where neither every
    candidate freed, nor that with the checkpoints offloaded, nor a shorter prefix of the
    ranking (:func:`shorter_prefixes`) fits it, naming the lowest of their peaks and
    ``lowest``'s. ``host``: the host memory left to the offloads (None: no limit): blocks and
    checkpoints are offloaded only while they fit it (``fit_offloads``, ``fit_checkpoints``,
    verified on the plans every candidate freed), the others recomputed or left on the
    device, their decisions saying why. ``give_up_at``: refused at once, naming that plan,
    where every candidate freed peaks at or above it (:func:`_free_at_some_depth`)."""
    margin = options.peak_memory_margin
    budget_bytes = budget.planned_for(user_bytes, margin)

    host_notes: dict[str, str] = {}  # the host levers the host could not take, and why

    def refuse(peak: int, plan: Plan, cands=(), checkpoints: int = 0, left_out: int = 0
               ) -> budget.MemoryBudgetError:
        cands = [c for c in cands if not is_part(c.block)]  # blocks freed whole
        offloaded = sum(1 for c in cands if c.offload)
        error = budget.refuse_below_minimum(user_bytes, peak, plan,
                                            recomputed=len(cands) - offloaded,
                                            offloaded=offloaded, margin=margin,
                                            resharded=resharded[1], checkpoints=checkpoints,
                                            left_out=left_out)
        if host_notes:  # the minimum is the device's with what the host could take
            error.args = (f"{error.args[0]} The host could not take every offload: "
                          f"{sorted(host_notes.items())[0][1]} ({len(host_notes)} offload(s) "
                          "left out); check_host_memory=False lifts this limit.",)
        return error

    estimates = block_estimates(probe, blocks, resharded[0].group_name, options, region,
                                tag_prefix)
    mode = options.activation_offload if isinstance(options.activation_offload, str) else "auto"
    link = agreed_link(probe, resharded[0].group_name, options, region, tag_prefix)
    everyone = free_candidates(blocks, estimates, mode, link)
    recomputable = (recompute_part_candidates(probe, blocks, estimates, options,
                                              resharded[0].group_name, region, tag_prefix)
                    if options.recompute_saved_values else [])
    everyone += part_candidates(blocks, everyone, estimates, mode, link,
                                resharded[0].group_name, region, tag_prefix,
                                recomputable=bool(recomputable))
    everyone += recomputable
    if not everyone:
        raise refuse(lowest[1], lowest[0])
    capacity = host.capacity if host is not None else None
    committed = host.base_bytes if host is not None else 0
    offloads: set[str] = set()

    def freeing(names, checkpointed=()) -> tuple[Plan, int]:
        # The named blocks, each by its lever; the ``checkpointed`` ones (recomputed) with
        # their checkpoints offloaded too: in both sets (shardc.passes.offload_saved). A
        # block's part is left out where the block is named whole (its lever frees the part).
        names = without_covered_parts(names)
        return evaluate(frozenset(n for n in names if n not in offloads),
                        frozenset(n for n in names if n in offloads) | frozenset(checkpointed))

    def freeing_all(chosen: list[recompute.RecomputeCandidate]) -> tuple[Plan, int]:
        offloads.clear()
        offloads.update(c.block for c in chosen if c.offload)
        return freeing(tuple(c.block for c in chosen))

    # Every candidate freed, its offloads fitted to the host's room (verified on that plan).
    cands, host_notes, floor_plan, floor = _within_host(
        host, committed,
        lambda room, scale: fit_offloads(everyone, blocks, link, room, capacity, committed,
                                         scale),
        freeing_all, "floor/")
    if not cands:
        raise refuse(lowest[1], lowest[0])
    note = ""
    if floor > budget_bytes and offloads and mode != "prefer":
        # Offloading every block may not lower the peak where recomputing does (a peak in the
        # backward of the block read last, whose saved values come back anyway): the levers'
        # other extreme, every block that can be recomputed recomputed, once.
        alt = free_candidates(blocks, estimates, "never", link)
        if alt:
            offloads = set()
            alt_plan, alt_floor = freeing(tuple(c.block for c in alt))
            if alt_floor < floor:
                note = (f"; offloading every block instead left the predicted peak at "
                        f"{floor} B, over the budget")
                cands, floor_plan, floor = alt, alt_plan, alt_floor
                host_notes = {}  # nothing offloaded, whatever the host holds
            else:
                offloads = {c.block for c in cands if c.offload}
    log.info("shardc: region %d: candidates to free (block, bytes, s, offload) %s; every one "
             "freed: peak %d B (resharded %d B)", region.index,
             [(c.block, c.nbytes, c.cost_s, c.offload) for c in cands], floor, resharded[1])
    if give_up_at is not None and floor >= give_up_at:
        raise refuse(floor, floor_plan, cands)  # not lower than a minimum already refused
    # The refusals' candidates, (peak, refuse's arguments), the levers' extremes first: the
    # lowest names the minimum (the first of equals, so a tie names what it always named).
    refusals = [(floor, (floor, floor_plan, cands)), (lowest[1], (lowest[1], lowest[0]))]
    if floor > budget_bytes and mode != "never":
        # Every block freed is not enough: the recomputed blocks' checkpoints (what they still
        # save, their inputs) offloaded too, the fewest that fit (docs/memory_budget.md).
        every = tuple(c.block for c in cands)
        checkpoints = checkpoint_candidates(probe, blocks, cands, estimates, link,
                                            resharded[0].group_name, region, tag_prefix)
        if checkpoints and host is not None:  # what every block freed left of the host
            used = host.used(floor_plan, "checkpoints")
            every_checkpoint = checkpoints
            checkpoints, ck_notes, ck_plan, ck_floor = _within_host(
                host, used,
                lambda room, scale: fit_checkpoints(every_checkpoint, room, capacity, used,
                                                    scale),
                lambda chosen: freeing(every, tuple(c.block for c in chosen)), "checkpoints/")
            host_notes = {**host_notes, **ck_notes}
        elif checkpoints:
            ck_plan, ck_floor = freeing(every, tuple(c.block for c in checkpoints))
        if checkpoints:
            log.info("shardc: region %d: checkpoints to offload (block, bytes, s) %s; every "
                     "one offloaded: peak %d B", region.index,
                     [(c.block, c.nbytes, c.cost_s) for c in checkpoints], ck_floor)
            if ck_floor <= budget_bytes:
                ck_chosen, peak, _ = recompute.choose(
                    checkpoints, budget_bytes, floor, ck_floor,
                    lambda names: freeing(every, names)[1])
                return MemoryBudget(
                    budget_bytes, ck_floor, peak, 0, [],
                    recompute.decisions(blocks, cands, every, needed=True, peak=peak,
                                        note=note, checkpoints=checkpoints,
                                        checkpointed=ck_chosen, freed_peak=floor,
                                        host_notes=host_notes),
                    resharded_bytes=resharded[1])
            refusals.append((ck_floor, (ck_floor, ck_plan, cands, len(checkpoints))))
    searched = cands  # the candidates whose ranking's prefixes are searched
    if floor > budget_bytes:
        # Every candidate freed is over the budget, yet freeing the last ones ranked may raise
        # the peak: shorter prefixes, the last tried before refusing.
        order = recompute.rank(cands)
        shorter = shorter_prefixes(order, floor, budget_bytes, freeing)
        refusals += [(p, (p, plan, order[:k], 0, len(order) - k)) for k, plan, p in shorter]
        if not shorter or shorter[-1][2] > budget_bytes:
            raise refuse(*min(refusals, key=lambda r: r[0])[1])
        k, floor_plan, floor = shorter[-1]
        searched = order[:k]
    chosen, peak, _ = recompute.choose(searched, budget_bytes, resharded[1], floor,
                                       lambda names: freeing(names)[1])
    chosen, peak = without_needless_parts(chosen, peak, budget_bytes,
                                          lambda names: freeing(names)[1])
    return MemoryBudget(budget_bytes, floor, peak, 0, [],
                        recompute.decisions(blocks, cands, chosen, needed=True, peak=peak,
                                            note=note, host_notes=host_notes),
                        resharded_bytes=resharded[1])


def shorter_prefixes(order: list[recompute.RecomputeCandidate], floor: int, budget_bytes: int,
                     build: Callable[[tuple[str, ...]], tuple[Plan, int]]
                     ) -> list[tuple[int, Plan, int]]:
    """Where every candidate of the ranking ``order`` freed peaks at ``floor``, over
    ``budget_bytes``: the prefixes one, two, ... short of every candidate, each verified
    (``build``: names -> plan and rank-uniform peak), while the one before lowered the peak and
    none fit, at most :data:`MAX_SHORTER` of them. Freeing a candidate can raise the peak: a
    block recomputed rebuilds its forward's activations at its backward, and the block whose
    backward runs first holds them beside the backward's first temporaries, where saving it
    would hold fewer (the parity llama at world 2: 373,248 B with both blocks recomputed,
    360,960 B with the first alone). Returns (length, plan, peak) per prefix verified, longest
    first; the last fits the budget where one does. Bounded and budget-blind (but for
    stopping at a fit): a refusal's minimum is the same at every budget it refuses."""
    out: list[tuple[int, Plan, int]] = []
    last = floor
    for k in range(len(order) - 1, max(len(order) - 1 - MAX_SHORTER, 0), -1):
        plan, peak = build(tuple(c.block for c in order[:k]))
        out.append((k, plan, peak))
        if peak <= budget_bytes or peak >= last:
            break
        last = peak
    return out


def block_estimates(probe: fx.GraphModule, blocks: list[Block], group: str,
                    options: ShardcOptions, region: SearchRegion, tag_prefix: str = ""
                    ) -> dict[str, tuple[int, int, float]]:
    """Per block: (bytes recomputing it frees, its saved bytes, its forward's seconds), each
    the largest over the ranks (one store exchange each, once per region), so every rank ranks
    the same candidates the same way."""
    profile = resolve_profile(options.cluster, device_name(probe))
    out = {}
    for b in blocks:
        tag = f"{tag_prefix}block{b.position}"
        freed = agree_on_largest(group, region.check_index, f"{tag}/bytes", b.freed_bytes)
        saved = agree_on_largest(group, region.check_index, f"{tag}/saved", b.saved_bytes)
        forward_ns = agree_on_largest(group, region.check_index, f"{tag}/ns",
                                      int(recompute.forward_seconds(probe, b, profile) * 1e9))
        out[b.name] = (freed, saved, forward_ns * 1e-9)
    return out


def checkpoint_candidates(probe: fx.GraphModule, blocks: list[Block],
                          cands: list[recompute.RecomputeCandidate],
                          estimates: dict[str, tuple[int, int, float]], link: HostLink,
                          group: str, region: SearchRegion, tag_prefix: str = ""
                          ) -> list[recompute.RecomputeCandidate]:
    """The recomputed candidates (``cands`` not offloaded) whose checkpoints may be offloaded
    too: each priced as the offload lever prices a block's values
    (``shardc.planning.offload.offload_seconds``: the copies' part not hidden behind the
    block's forward, and behind twice it for the prefetch), on its checkpoint's bytes
    (``shardc.passes.recompute.checkpoint_bytes``, the largest over the ranks: one store
    exchange per block)."""
    local = checkpoint_bytes(blocks, compute_device_type(probe.graph))
    by_name = {b.name: b for b in blocks}
    out = []
    for c in cands:
        if c.offload or is_part(c.block):  # a recomputed part's block keeps its checkpoint
            continue
        nbytes = agree_on_largest(group, region.check_index,
                                  f"{tag_prefix}block{by_name[c.block].position}/checkpoint",
                                  local.get(c.block, 0))
        if nbytes <= 0:
            continue
        forward_s = estimates[c.block][2]
        d2h = link.copy_seconds(nbytes, to_device=False)
        h2d = link.copy_seconds(nbytes, to_device=True)
        exposed = offload_lever.offload_seconds(d2h, forward_s, h2d)
        out.append(recompute.RecomputeCandidate(
            c.block, c.kind, c.position, exposed, nbytes, offload=True, forward_s=forward_s,
            copy_s=max(d2h, h2d), offload_s=exposed))
    return out


def agreed_link(probe: fx.GraphModule, group: str, options: ShardcOptions,
                region: SearchRegion, tag_prefix: str = "") -> HostLink:
    """The host link of the cluster profile (``offload.link_of``), each figure the slowest over
    the ranks (femtoseconds per byte and nanoseconds of latency exchanged as integers, one store
    exchange each), so that every rank prices offload the same. ``tag_prefix``: of the
    exchanges' tags, as :func:`choose_device_levers`'s."""
    link = offload_lever.link_of(resolve_profile(options.cluster, device_name(probe)))

    def slowest_rate(key: str, rate: float) -> float:
        fs_per_byte = agree_on_largest(group, region.check_index, f"{tag_prefix}link/{key}",
                                       round(1e15 / rate))
        return 1e15 / fs_per_byte

    d2h = slowest_rate("link_bytes_per_s", link.device_to_host_bytes_per_s)
    h2d = slowest_rate("h2d_bytes_per_s", link.host_to_device_bytes_per_s)
    latency_ns = agree_on_largest(group, region.check_index, f"{tag_prefix}link/latency",
                                  round(link.latency_s * 1e9))
    return HostLink(d2h, h2d, latency_ns * 1e-9)


def free_candidates(blocks: list[Block], estimates: dict[str, tuple[int, int, float]],
                    mode: str, link: HostLink) -> list[recompute.RecomputeCandidate]:
    """The blocks whose saved activations the planner may free, each with its cheaper lever
    (recompute, or offload to the host: ``shardc.planning.offload.choose_lever``, under
    ``activation_offload`` ``mode``, over the host ``link``: the cluster profile's,
    :func:`agreed_link`)."""
    cands = []
    for b in blocks:
        freed, saved, forward_s = estimates[b.name]
        lever = offload_lever.choose_lever(
            forward_s=forward_s, recompute_bytes=freed, offload_bytes=saved,
            can_recompute=not b.excluded, link=link, mode=mode)
        if lever is not None:
            cands.append(recompute.RecomputeCandidate(
                b.name, b.kind, b.position, lever.cost_s, lever.nbytes, offload=lever.offload,
                forward_s=forward_s, copy_s=lever.copy_s, offload_s=lever.offload_s))
    return cands


def recompute_part_candidates(probe: fx.GraphModule, blocks: list[Block],
                              estimates: dict[str, tuple[int, int, float]],
                              options: ShardcOptions, group: str, region: SearchRegion,
                              tag_prefix: str = "") -> list[recompute.RecomputeCandidate]:
    """Per compile-once block, its saved values the backward can compute again by elementwise
    work alone (``Block.recomputable``, ``shardc.passes.recompute_part``), as one candidate:
    priced by their cones' kernels (``recompute.part_seconds``), freeing their bytes. Bytes
    and nanoseconds are the largest over the ranks (one store exchange each per block), so
    every rank ranks the same candidates the same way; which values are recomputable follows
    from the body's graph, the same on every rank. A sunk body (``sink_block_residual``)
    offers its parts like any other (its pair's gradient is read once:
    ``shardc.passes.repeated_body_outputs``)."""
    profile = resolve_profile(options.cluster, device_name(probe))
    out = []
    for b in blocks:
        if not b.recomputable or b.excluded:
            continue
        tag = f"{tag_prefix}block{b.position}"
        sizes = agree_on_largest_each(
            group, region.check_index, f"{tag}/recomputable",
            [tensor_nbytes(b.saved_values[i].meta.get("val")) for i in b.recomputable])
        ns = agree_on_largest(group, region.check_index, f"{tag}/recomputable_ns",
                              int(recompute.part_seconds(probe, b, b.recomputable, profile)
                                  * 1e9))
        out.append(recompute.RecomputeCandidate(
            part_name(b.name, b.recomputable), b.kind, b.position, ns * 1e-9, sum(sizes),
            forward_s=estimates[b.name][2]))
    return out


def part_candidates(blocks: list[Block], wholes: list[recompute.RecomputeCandidate],
                    estimates: dict[str, tuple[int, int, float]], mode: str, link: HostLink,
                    group: str, region: SearchRegion, tag_prefix: str = "",
                    recomputable: bool = False) -> list[recompute.RecomputeCandidate]:
    """Per block, the part of its saved values whose copies its forward hides
    (``shardc.planning.offload.hidden_part``), as a candidate of no exposed time: where the
    block's own lever (``wholes``) is not already an offload its forward hides, and the part is
    neither empty nor every value. The values' bytes are the largest over the ranks (one store
    exchange per block), so every rank names the same part. Only under
    ``activation_offload='auto'``: ``'never'`` offloads nothing, ``'prefer'`` offloads blocks
    whole wherever it can. ``recomputable``: the values a block's recompute part may take
    (``Block.recomputable``, :func:`recompute_part_candidates`) are left out of its part, so
    the two parts never name one value."""
    if mode != "auto":
        return []
    whole = {c.block: c for c in wholes}
    out = []
    for b in blocks:
        c = whole.get(b.name)
        if not b.saved_values or c is not None and c.offload and c.offload_s == 0.0:
            continue
        sizes = agree_on_largest_each(group, region.check_index,
                                      f"{tag_prefix}block{b.position}/values",
                                      [tensor_nbytes(v.meta.get("val")) for v in b.saved_values])
        forward_s = estimates[b.name][2]
        left = set(b.recomputable) if recomputable and not b.excluded else set()
        others = [i for i in range(len(sizes)) if i not in left]
        part = [others[i] for i in
                offload_lever.hidden_part([sizes[i] for i in others], forward_s, link)]
        if not part or len(part) == len(sizes):
            continue
        nbytes = sum(sizes[i] for i in part)
        copy_s = max(link.copy_seconds(nbytes, to_device=False),
                     link.copy_seconds(nbytes, to_device=True))
        out.append(recompute.RecomputeCandidate(
            part_name(b.name, part), b.kind, b.position, 0.0, nbytes, offload=True,
            forward_s=forward_s, copy_s=copy_s, offload_s=0.0))
    return out


def without_needless_parts(chosen: list[str], peak: int, budget_bytes: int,
                           evaluate: Callable[[tuple[str, ...]], int]) -> tuple[list[str], int]:
    """``chosen`` (a prefix of the ranking: parts first, then blocks freed whole) and its
    verified ``peak``, less its parts where the blocks it frees whole fit ``budget_bytes``
    without them (one more trial, ``evaluate``: names -> rank-uniform peak): a part's copies
    cost host memory, copy-lane time and, for the last one, a wait; they are kept only where
    the budget needs them."""
    wholes = [n for n in chosen if not is_part(n)]
    if not wholes or len(wholes) == len(chosen):
        return chosen, peak
    alone = evaluate(tuple(wholes))
    return (wholes, alone) if alone <= budget_bytes else (chosen, peak)


def without_covered_parts(names: Collection[str]) -> tuple[str, ...]:
    """``names`` less the parts (``shardc.planning.plan.part_name``) of blocks also named
    whole: a block recomputed or offloaded whole saves no value of its own a part could
    offload."""
    whole = {n for n in names if not is_part(n)}
    return tuple(n for n in names if not is_part(n) or split_part(n)[0] not in whole)


def gather_device(gm: fx.GraphModule) -> torch.device | None:
    sent = [GatherArgs.of(n).shard.meta.get("val") for n in gm.graph.nodes
            if is_call(n, GATHER_OP)]
    return sent[0].device if sent and sent[0] is not None else None


