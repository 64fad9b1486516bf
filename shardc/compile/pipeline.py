"""The pipeline: what shardc does to one compiled region, in order.

:func:`joint_passes` runs on the joint forward-backward graph, before the partitioner;
:func:`partition` splits it; :func:`plan_and_lower` plans the partitioned graphs and rewrites
them. Nothing here knows Dynamo, AOTAutograd or Inductor: :mod:`shardc.compile.backend` calls
these functions from their hooks, and :mod:`shardc.tools.template` calls
:func:`plan_and_lower` on graphs it built itself.

1. FP8 (``shardc.passes.fp8``): merge amax all-reduces, dedupe FP8 gathers, tag dequantization.
2. Dedupe (``shardc.passes.dedupe``): one gather and one reduction per parameter.
3. Reshard (``shardc.passes.reshard``): resharded gathers must be recomputed in backward.
4. Partition (torch's min-cut), put the saved values back in the order AOTAutograd reads them
   (``shardc.passes.saved_order``), then check that no gathered parameter is saved.
5. Plan (``shardc.planning.schedule``): buckets, issue and wait positions, simulation; place the
   buffers in the pool (``shardc.memory.pool``); while the pool exceeds the memory budget, plan
   again with shallower prefetch.
6. Lower (``shardc.passes.lower``): bucketed functional collectives at the planned positions,
   their buffers views of the region's pool.
7. Predict the step's peak memory (``shardc.memory.peak``); dump the plan if asked.

With a whole-step peak budget (``peak_memory_budget_bytes``), :func:`partition_and_plan` runs
steps 1-7 on copies of the joint graph for a bounded number of configurations (which buckets
stay gathered from the forward to the backward, ``shardc.planning.budget``; which blocks are
recomputed in the backward, ``shardc.planning.recompute``, tagged after step 3 by
``shardc.passes.recompute``) before it builds the chosen one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from shardc import _torch
from shardc.compile import progress
from shardc.compile.options import ShardcOptions
from shardc.memory.host import (
    activation_host_bytes,
    activation_host_values,
    device_copy_bytes,
    find_host_state,
    host_values,
    optimizer_host_bytes,
)
from shardc.memory.peak import param_placeholders, predict_peak
from shardc.memory.pool import assign_pool
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.body import BodyCall
from shardc.passes.dedupe import dedupe_gathers, merge_reduce_scatters
from shardc.passes.fp8 import Fp8Summary, hoist_fp8_quantize, prepare_fp8
from shardc.passes.fx_utils import allocate_real, copy_graph_module, is_call
from shardc.passes.lower import add_pool_placeholder, apply_plan
from shardc.passes.offload_dedupe import dedupe_device_copies
from shardc.passes.offload_saved import OffloadedValue, block_groups, offload_saved
from shardc.passes.recompute import Block, find_blocks, recompute_blocks
from shardc.passes.reshard import check_no_gathered_saved, keep_gathered, tag_resharded_gathers
from shardc.passes.saved_order import order_saved_values
from shardc.planning import budget, optimizer_offload, prefetch, recompute
from shardc.planning import offload as offload_lever
from shardc.planning.estimate import elided_cast_seconds
from shardc.planning.plan import (
    CompiledBody,
    InlineBlock,
    MemoryBudget,
    Plan,
    PrefetchDecision,
    PrefetchTrial,
)
from shardc.planning.profile import resolve_profile
from shardc.planning.schedule import device_name, plan_region
from shardc.runtime.collectives import resolve_group
from shardc.runtime.plan_check import agree_on_largest

log = logging.getLogger("shardc")


@dataclass
class RegionRecord:
    """What shardc keeps about one compiled region: its graphs, its plan and its pool."""

    index: int
    # Process group name -> (role on the mesh, ranks), for the plan (MeshLayout.group_roles).
    groups: dict[str, tuple[str, int]] | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    plan: Plan | None = None
    checked: bool = False
    pool: torch.Tensor | None = None
    check_index: int | None = None  # the region's number for the cross-rank plan check
    fp8: Fp8Summary | None = field(default=None, repr=False)  # what the FP8 passes did
    # Block bodies (shardc.passes.body): the calls in Dynamo's graph, the blocks that keep the
    # inline path, and how many times each body's joint graph was partitioned.
    body_calls: list[BodyCall] = field(default_factory=list, repr=False)
    inline_blocks: list[tuple[str, str]] = field(default_factory=list, repr=False)
    body_partitions: dict[str, int] = field(default_factory=dict)
    # Optimizer-only CPU offload (OffloadPolicy(params=False, optimizer=True)): the optimizer's
    # state and step live on the host (shardc.runtime.offload_optimizer), not in the device peak.
    optimizer_on_host: bool = False
    # CPU offload of the parameters (OffloadPolicy()): the model's key, which the backward's
    # per-bucket "host gradients ready" signals carry (shardc.optim.step_in_backward).
    offload_key: str = ""


# Set by capture_partitioned(): where regions compiled in its scope leave their partitioned graphs.
_PARTITIONED_SINK: ContextVar[list | None] = ContextVar("shardc_partitioned_sink", default=None)


# Set by plan_only(): compilation stops once a region is planned (nothing is compiled).
_PLAN_ONLY: ContextVar[bool] = ContextVar("shardc_plan_only", default=False)


class PlannedOnly(Exception):
    """Raised by :func:`plan_and_lower` inside :func:`plan_only` once the region is planned."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(f"shardc: region {plan.region} planned; compilation stopped (plan_only)")
        self.plan = plan


@contextlib.contextmanager
def plan_only() -> Iterator[None]:
    """Stop every region compiled in this context right after shardc plans, lowers and predicts
    it, before any code is generated (planning on the meta device, where Inductor could not
    compile): :func:`plan_and_lower` raises :class:`PlannedOnly`, which torch.compile passes on
    wrapped in its backend-failure exception (``shardc._torch.backend_failure_cause``). The
    region's record keeps its graphs and plan."""
    token = _PLAN_ONLY.set(True)
    try:
        yield
    finally:
        _PLAN_ONLY.reset(token)


@contextlib.contextmanager
def capture_partitioned() -> Iterator[list[tuple[fx.GraphModule, fx.GraphModule]]]:
    """Collect a copy of the partitioned, not yet planned ``(forward, backward)`` graphs of every
    training region compiled inside this context (``shardc.tools.template`` repeats them to plan
    a deeper model). The regions themselves are planned and compiled as usual."""
    sink: list = []
    token = _PARTITIONED_SINK.set(sink)
    try:
        yield sink
    finally:
        _PARTITIONED_SINK.reset(token)


def partitioned_graphs_wanted() -> bool:
    """Whether the caller wants the partitioned graphs themselves (:func:`plan_only`,
    :func:`capture_partitioned`), which a compile cache hit would not produce."""
    return _PLAN_ONLY.get() or _PARTITIONED_SINK.get() is not None


def joint_passes(graph: fx.Graph, *, training: bool = True) -> Fp8Summary | None:
    """Steps 1-3 on a joint graph (``training``) or a forward-only one (gathers only)."""
    fp8 = prepare_fp8(graph)
    dedupe_device_copies(graph)  # CPU offload: tied weights' copies, so their gathers merge
    dedupe_gathers(graph)
    if training:
        merge_reduce_scatters(graph)
        tag_resharded_gathers(graph)
    return fp8


def partition(gm: fx.GraphModule, joint_inputs: Sequence[object], *, record: bool = True,
              **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Step 4: the min-cut partition of the joint graph, checked (``record``: handed to the
    partitioned-graph sink, which the budget planner's trials are not)."""
    fw, bw = _torch.min_cut_partition(gm, joint_inputs, **kwargs)
    # The parameters' DeviceMesh is saved for the backward (it builds the DTensor gradients);
    # checkpointed random ops (SDPA, dropout) save RNG states behind it, out of the order
    # AOTAutograd reads saved values in: put them back (shardc/passes/saved_order.py).
    order_saved_values(fw, bw, kwargs["num_fwd_outputs"])
    check_no_gathered_saved(fw, bw)
    sink = _PARTITIONED_SINK.get() if record else None
    if sink is not None:
        sink.append((copy_graph_module(fw), copy_graph_module(bw)))
    return fw, bw


def plan_and_lower(fw: fx.GraphModule, bw: fx.GraphModule | None, options: ShardcOptions,
                   region: RegionRecord, *, budget: MemoryBudget | None = None) -> Plan:
    """Steps 5-7 on a region's partitioned graphs (``bw``: None for a forward-only graph);
    records the graphs, the plan (with ``budget``'s decisions) and the pool in ``region`` and
    returns the plan."""
    plan, pool = lower_and_predict(fw, bw, options, region)
    plan.budget = budget
    region.pool = pool
    region.forward, region.backward, region.plan = fw, bw, plan
    dump_if_asked(plan, options)
    if _PLAN_ONLY.get():
        raise PlannedOnly(plan)
    return plan


def dump_if_asked(plan: Plan, options: ShardcOptions) -> None:
    """Write the plan's dump where ``options.dump_dir`` asks (never fails the compile)."""
    if not options.dump_dir:
        return
    from shardc.tools.render import dump_plan

    try:
        dump_plan(plan, options.dump_dir, rank=rank_in_plan(plan))
    except OSError as exc:  # a dump must never break training
        log.warning("shardc: could not write the plan dump: %s", exc)


def lower_and_predict(fw: fx.GraphModule, bw: fx.GraphModule | None, options: ShardcOptions,
                      region: RegionRecord, *, pool_device: torch.device | None = None
                      ) -> tuple[Plan, torch.Tensor | None]:
    """Plan, lower and predict the peak of ``fw``/``bw`` (changed in place); returns the plan
    and the communication pool, allocated on ``pool_device`` if given (``meta`` for the budget
    planner's trials, which only predict) or else on the parameters' device."""
    hoist_fp8_quantize(fw)
    hoist_fp8_quantize(bw)
    with progress.stage(region.index, "planning"):
        plan = plan_within_budget(fw, bw, options, region)
    if region.fp8 is not None:
        plan.notes.append(region.fp8.note())
    record_bodies(plan, region)
    fw_params = param_placeholders(fw)
    bw_params = param_placeholders(bw) if bw is not None else set()
    host = find_host_state(fw, bw)  # CPU offload: what lives on the host
    rank = rank_in_plan(plan)
    pool = allocate_pool(fw, plan, options, pool_device) if bw is not None else None
    with progress.stage(region.index, "lowering"):
        for gm, name in ((fw, "forward"), (bw, "backward")):
            if gm is None:
                continue
            # Inductor sees the pool as a graph input it writes into (a constant would be copied
            # or folded); the compiled graph's caller appends it (backend._inductor_with_pool).
            where = add_pool_placeholder(gm, pool) if pool is not None and options.inductor \
                else pool
            apply_plan(gm, plan, name, rank, pool=where, poison=options.debug_pool,
                       grads_ready_key=region.offload_key)
    on_host = region.optimizer_on_host
    with progress.stage(region.index, "peak prediction"):
        predict_peak(fw, bw, plan, fw_params, bw_params,
                     optimizer_state_factor=0.0 if on_host else options.optimizer_state_factor,
                     optimizer_temp_factor=0.0 if on_host else options.optimizer_temp_factor,
                     persistent_bytes=pool.numel() if pool is not None else 0,
                     fusion=options.inductor,
                     host=host.params | host.bw_params | host_values(fw) | host_values(bw)
                     | activation_host_values(fw, bw))
        record_host_bytes(plan, host, fw, options, on_host)
    return plan, pool


def record_host_bytes(plan: Plan, host, fw: fx.GraphModule, options: ShardcOptions,
                      on_host: bool) -> None:
    """``plan.predicted.host_bytes``: CPU offload's masters, gradients and optimizer state (or,
    optimizer-only, the host masters, their gradients and state), plus the saved activations
    the forward offloads; ``device_copy_bytes`` where there are copies."""
    total, known = 0.0, False
    if any(c.origin == "shardc" for c in plan.copies):
        total, known = float(host.host_bytes(options.optimizer_state_factor)), True
    elif on_host:
        total, known = float(optimizer_host_bytes(
            plan.predicted.param_bytes or 0.0, options.optimizer_state_factor)), True
    activations = activation_host_bytes(fw)
    if known or activations:
        plan.predicted.host_bytes = total + activations
    if plan.copies:
        plan.predicted.device_copy_bytes = float(device_copy_bytes(plan))


def partition_and_plan(gm: fx.GraphModule, joint_inputs: Sequence[object], options: ShardcOptions,
                       region: RegionRecord, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Steps 1-7 on a training region's joint graph; returns the planned forward and backward.

    With a peak budget (``peak_memory_budget_bytes``) the budget planner
    (``shardc.planning.budget``) first evaluates configurations on copies of the joint graph
    (each partitioned, planned and predicted), then the chosen one is built for real. Without
    one, this is the fixed policy, unchanged."""
    decided = None
    if options.peak_memory_budget_bytes:
        with progress.stage(region.index, "peak budget"):
            decided = choose_under_budget(gm, joint_inputs, options, region, **kwargs)
        keep_gathered(gm.graph, kept_params(decided))
    recomputed = set(decided.recomputed) if decided is not None else set()
    offloaded = set(decided.offloaded) if decided is not None else set(options.forced_offload())
    with progress.stage(region.index, "joint passes + partition"):
        region.fp8 = joint_passes(gm.graph)
        blocks = region_blocks(gm, region, kwargs) if recomputed or offloaded else []
        if recomputed:
            recompute_blocks(gm, blocks, recomputed)
        gm.recompile()
        fw, bw = partition(gm, joint_inputs, **kwargs)
    done = offload_activations(fw, bw, kwargs["num_fwd_outputs"], blocks, offloaded)
    if decided is not None and decided.prefetch is not None:
        options = with_depth(options, decided.prefetch.depth)
    plan = plan_and_lower(fw, bw, options, region, budget=decided)
    if offloaded and decided is None:
        plan.notes.append(forced_offload_note(done, blocks, offloaded))
    return fw, bw


def offload_activations(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                        blocks: Sequence[Block], names: set[str]) -> list[OffloadedValue]:
    """Offload the saved activations of the blocks named ``names`` (``"*"``: all) from the
    partitioned graphs (``shardc.passes.offload_saved``), before they are planned."""
    if not names:
        return []
    return offload_saved(fw, bw, num_fwd_outputs,
                         block_groups(fw, num_fwd_outputs, blocks, names))


def forced_offload_note(done: list[OffloadedValue], blocks: Sequence[Block],
                        names: set[str]) -> str:
    """The plan's note on a forced activation offload (``activation_offload=(blocks...)``)."""
    found = sorted({v.group for v in done})
    here = {b.name for b in blocks}
    absent = sorted(n for n in names if n != "*" and n not in here)
    nbytes = sum(v.nbytes for v in done)
    return (f"activation offload (activation_offload): {len(done)} saved value(s) of "
            f"{len(found)} block(s) {found} copied to the host in the forward and prefetched "
            f"for the backward ({nbytes} B)"
            + (f"; named but not blocks of this region: {absent}" if absent else "")
            + ("; this region has no blocks (the children with parameters of an "
               "nn.ModuleList of two or more, shardc.sharding.blocks)" if not blocks else ""))


def kept_params(decided: MemoryBudget) -> set[str]:
    return {p for d in decided.decisions if d.kept for p in d.params}


def region_blocks(gm: fx.GraphModule, region: RegionRecord, kwargs: dict) -> list[Block]:
    """The blocks of a region's joint graph (after the joint passes): its compile-once body
    calls and its inline blocks (``shardc.passes.recompute.find_blocks``)."""
    return find_blocks(gm, kwargs["num_fwd_outputs"], [c.block for c in region.body_calls],
                       [module for module, _ in region.inline_blocks])


def choose_under_budget(gm: fx.GraphModule, joint_inputs: Sequence[object],
                        options: ShardcOptions, region: RegionRecord, **kwargs) -> MemoryBudget:
    """The budget planner's decisions for one region's joint graph (left unchanged): the levers
    on the device (:func:`choose_device_levers`) and, where their feasible minimum is over the
    budget, the last one: the optimizer's state on the host, with the device levers chosen
    again under it (``shardc.planning.optimizer_offload``). Refused, naming the minimum, where
    even that is over the budget."""
    unavailable = ("the optimizer's state is on the host already" if region.optimizer_on_host
                   else _optimizer_offload_unavailable(gm, options))
    try:
        return choose_device_levers(gm, joint_inputs, options, region,
                                    step_floor_exits=not unavailable, **kwargs)
    except optimizer_offload.StepOverBudget as over:
        floor, floor_plan, exact = over.floor_bytes, over.plan, False
    except budget.MemoryBudgetError as refused:
        floor = getattr(refused, "minimum_bytes", None)
        if floor is None:  # not a budget below the minimum ("auto" off CUDA)
            raise
        if region.optimizer_on_host:  # already there (OffloadPolicy, or an earlier region)
            raise _refusal(refused, optimizer_offload.refusal_hint(True, "")) from None
        if unavailable:
            log.info("shardc: region %d: optimizer offload not tried: %s", region.index,
                     unavailable)
            raise _refusal(refused, optimizer_offload.refusal_hint(False, unavailable)) from None
        floor_plan, exact = refused.plan, True
    region.optimizer_on_host = True  # every prediction below leaves the state to the host
    try:
        decided = choose_device_levers(gm, joint_inputs, options, region,
                                       tag_prefix="host/", **kwargs)
    except budget.MemoryBudgetError as again:
        region.optimizer_on_host = False
        if getattr(again, "minimum_bytes", None) is None:
            raise
        raise _refusal(again, optimizer_offload.refusal_hint(True, "", floor, exact)) from None
    decided.optimizer = _optimizer_decision(floor_plan, floor, exact, decided, options, region,
                                            device_name(gm))
    # A warning: the host step costs far more than any device lever (seconds per step at 1e9
    # parameters); the user may prefer a larger budget or more ranks.
    log.warning("shardc: region %d: the peak budget puts the optimizer's state and step on the "
                "host (optimizer_offload='never' turns this off): %s", region.index,
                decided.optimizer.reason)
    return decided


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
                        options: ShardcOptions, region: RegionRecord, device: str | None):
    """The record of the optimizer's state put on the host, priced from the device levers'
    floor plan (``floor_plan``, peak ``floor``; not ``exact``: ``floor`` is the optimizer
    step's peak, under every configuration's); every number the largest over the ranks."""
    group, index = floor_plan.group_name, region.check_index

    def largest(tag: str, value: float) -> int:
        return agree_on_largest(group, index, f"optimizer/{tag}", int(value or 0))

    p = floor_plan.predicted
    param_bytes = largest("param_bytes", p.param_bytes)
    grad_bytes = largest("grad_bytes", p.grad_bytes)
    freed = int(param_bytes * (options.optimizer_state_factor + options.optimizer_temp_factor))
    n_params = largest("numel", _shard_numel(floor_plan))
    profile = resolve_profile(options.cluster, device)
    return optimizer_offload.decision(
        freed_bytes=freed, host_bytes=optimizer_host_bytes(param_bytes,
                                                           options.optimizer_state_factor),
        n_params=n_params, param_bytes=param_bytes, grad_bytes=grad_bytes, profile=profile,
        floor_bytes=floor, peak_bytes=decided.peak_bytes, exact=exact)


def _shard_numel(plan: Plan) -> int:
    """Elements of a rank's parameter shards, padding included (the largest rank's)."""
    seen, total = set(), 0
    for b in plan.buckets:
        for fqn, rows, row_numel in zip(b.params, b.padded_rows, b.row_numel):
            if fqn not in seen:
                seen.add(fqn)
                total += rows * row_numel
    return total


def choose_device_levers(gm: fx.GraphModule, joint_inputs: Sequence[object],
                         options: ShardcOptions, region: RegionRecord, tag_prefix: str = "",
                         step_floor_exits: bool = False, **kwargs) -> MemoryBudget:
    """The decisions of the levers on the device for one region's joint graph (left
    unchanged): the fully resharded configuration first; within the budget, the greedy keeps
    buckets gathered; over it, every bucket kept is tried once, then blocks are recomputed or
    their activations offloaded (refused if the fully freed plan is still over the budget);
    a shallower prefetch depth is tried before those, and the chosen configuration's depth is
    decided last (:func:`_choose_prefetch`). ``tag_prefix``: of the cross-rank exchanges' tags
    (each tag once per region), for a second search under other conditions (the optimizer's
    state on the host). ``step_floor_exits``:
    raise :class:`optimizer_offload.StepOverBudget` as soon as the optimizer step's peak alone
    is over the budget (the caller then puts the state on the host)."""
    pristine = copy_graph_module(gm)
    user_bytes = budget.resolve_budget(options.peak_memory_budget_bytes, _gather_device(gm))
    margin = options.peak_memory_margin
    # Every decision is made against the budget less the margin for the prediction's error;
    # the record names both (budget.with_margin).
    budget_bytes = budget.planned_for(user_bytes, margin)
    # The trials' dumps and plan-only stops belong to the real plan only.
    trial_options = replace(options, dump_dir=None)
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
        trial = copy_graph_module(pristine)
        keep_gathered(trial.graph, kept)
        joint_passes(trial.graph)
        found = region_blocks(trial, region, kwargs) if recomputed or offloaded else []
        if recomputed:
            recompute_blocks(trial, found, set(recomputed))
        trial.recompile()
        fw, bw = partition(trial, joint_inputs, record=False, **kwargs)
        offload_activations(fw, bw, kwargs["num_fwd_outputs"], found, set(offloaded))
        plan, _ = lower_and_predict(fw, bw, with_depth(trial_options, depth), region,
                                    pool_device=torch.device("meta"))
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
    if step_floor_exits:
        # The optimizer step's shards, gradients, state and temporaries are the same in every
        # configuration of these levers: over the budget, none can meet it.
        step = base.predicted
        factor = 1 + options.optimizer_state_factor + options.optimizer_temp_factor
        floor = agree_on_largest(base.group_name, region.check_index, f"{tag_prefix}step",
                                 int((step.param_bytes or 0) * factor + (step.grad_bytes or 0)))
        if floor > budget_bytes:
            raise optimizer_offload.StepOverBudget(floor, base)
    probe = copy_graph_module(pristine)  # the joint passes' graph, where blocks are found
    joint_passes(probe.graph)
    blocks = region_blocks(probe, region, kwargs)
    cands, fixed = budget.candidates(base, elided_cast_seconds(
        pristine, resolve_profile(options.cluster, device_name(pristine))))
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
            # Memory is short: blocks are freed at the shallowest depth tried (then one deeper
            # is tried on the result, below).
            current = min((k[3] for k in evaluated if not any(k[:3])), default=default_depth)
            try:
                decided = _recompute_under_budget(
                    probe, blocks, user_bytes, evaluate(set(), depth=current), lowest, options,
                    region, lambda recomputed, offloaded: evaluate(set(), recomputed, offloaded,
                                                                   current),
                    tag_prefix=tag_prefix)
            except budget.MemoryBudgetError as exc:
                # The fully resharded plan's peak at the options' depth (the fixed policy's)
                # and at each depth tried (the ranks' largest).
                exc.resharded_bytes = minimum
                exc.resharded_by_depth = {k[3]: v[1] for k, v in evaluated.items()
                                          if not any(k[:3])}
                raise
            decided.decisions = budget.reshard_all(cands, fixed, minimum)
    decided.prefetch = _choose_prefetch(
        lambda d: depth_trial(kept_params(decided), decided.recomputed, decided.offloaded, d),
        base, default_depth, budget_bytes, current)
    decided.peak_bytes = decided.prefetch.peak_bytes
    decided.trials = len(evaluated) - 1
    budget.with_margin(decided, user_bytes, margin)
    log.info("shardc: region %d, peak budget %d B (planned for %d B): minimum %d B, kept "
             "gathered %s, recomputed %s, offloaded %s, predicted peak %d B (%d trials)",
             region.index, user_bytes, budget_bytes, decided.minimum_bytes, decided.kept,
             decided.recomputed, decided.offloaded, decided.peak_bytes, decided.trials)
    return decided


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


def _recompute_under_budget(probe: fx.GraphModule, blocks: list[Block], user_bytes: int,
                            resharded: tuple[Plan, int], lowest: tuple[Plan, int],
                            options: ShardcOptions, region: RegionRecord,
                            evaluate, tag_prefix: str = "") -> MemoryBudget:
    """The blocks to recompute when no configuration of the first lever fits (``resharded``:
    the fully resharded plan and its peak; ``lowest``: the lower of it and the fully kept
    one); refuses the budget (``user_bytes``, planned for less its margin) if the fully
    recomputed plan is still over it."""
    margin = options.peak_memory_margin
    budget_bytes = budget.planned_for(user_bytes, margin)

    def refuse(peak: int, plan: Plan, cands=()) -> budget.MemoryBudgetError:
        offloaded = sum(1 for c in cands if c.offload)
        return budget.refuse_below_minimum(user_bytes, peak, plan,
                                           recomputed=len(cands) - offloaded,
                                           offloaded=offloaded, margin=margin,
                                           resharded=resharded[1])

    estimates = block_estimates(probe, blocks, resharded[0].group_name, options, region,
                                tag_prefix)
    mode = options.activation_offload if isinstance(options.activation_offload, str) else "auto"
    link = agreed_link(probe, resharded[0].group_name, options, region, tag_prefix)
    cands = free_candidates(blocks, estimates, mode, link)
    if not cands:
        raise refuse(lowest[1], lowest[0])
    offloads = {c.block for c in cands if c.offload}

    def freeing(names) -> tuple[Plan, int]:  # the named blocks, each by its lever
        return evaluate(frozenset(n for n in names if n not in offloads),
                        frozenset(n for n in names if n in offloads))

    floor_plan, floor = freeing(tuple(c.block for c in cands))
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
            else:
                offloads = {c.block for c in cands if c.offload}
    log.info("shardc: region %d: candidates to free (block, bytes, s, offload) %s; every one "
             "freed: peak %d B (resharded %d B)", region.index,
             [(c.block, c.nbytes, c.cost_s, c.offload) for c in cands], floor, resharded[1])
    if floor > budget_bytes:  # refused, naming the lowest peak of the levers' extremes
        if lowest[1] < floor:
            raise refuse(lowest[1], lowest[0])
        raise refuse(floor, floor_plan, cands)
    chosen, peak, _ = recompute.choose(cands, budget_bytes, resharded[1], floor,
                                       lambda names: freeing(names)[1])
    return MemoryBudget(budget_bytes, floor, peak, 0, [],
                        recompute.decisions(blocks, cands, chosen, needed=True, peak=peak,
                                            note=note),
                        resharded_bytes=resharded[1])


def block_estimates(probe: fx.GraphModule, blocks: list[Block], group: str,
                    options: ShardcOptions, region: RegionRecord, tag_prefix: str = ""
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


def agreed_link(probe: fx.GraphModule, group: str, options: ShardcOptions,
                region: RegionRecord, tag_prefix: str = "") -> dict[str, float]:
    """The host link of the cluster profile (``offload.link_of``), each figure the slowest over
    the ranks (femtoseconds per byte and nanoseconds of latency exchanged as integers, one store
    exchange each), so that every rank prices offload the same. ``tag_prefix``: of the
    exchanges' tags, as :func:`choose_device_levers`'s."""
    link = offload_lever.link_of(resolve_profile(options.cluster, device_name(probe)))
    out = {}
    for key in ("link_bytes_per_s", "h2d_bytes_per_s"):
        fs_per_byte = agree_on_largest(group, region.check_index, f"{tag_prefix}link/{key}",
                                       round(1e15 / link[key]))
        out[key] = 1e15 / fs_per_byte
    out["latency_s"] = agree_on_largest(group, region.check_index, f"{tag_prefix}link/latency",
                                        round(link["latency_s"] * 1e9)) * 1e-9
    return out


def free_candidates(blocks: list[Block], estimates: dict[str, tuple[int, int, float]],
                    mode: str, link: dict[str, float] | None = None
                    ) -> list[recompute.RecomputeCandidate]:
    """The blocks whose saved activations the planner may free, each with its cheaper lever
    (recompute, or offload to the host: ``shardc.planning.offload.choose_lever``, under
    ``activation_offload`` ``mode``, over the host ``link``: ``offload.link_of`` the cluster
    profile; default: the unmeasured constants)."""
    cands = []
    for b in blocks:
        freed, saved, forward_s = estimates[b.name]
        lever = offload_lever.choose_lever(
            forward_s=forward_s, recompute_bytes=freed, offload_bytes=saved,
            can_recompute=not b.excluded, mode=mode, **(link or {}))
        if lever is not None:
            cands.append(recompute.RecomputeCandidate(
                b.name, b.kind, b.position, lever.cost_s, lever.nbytes, offload=lever.offload,
                forward_s=forward_s, copy_s=lever.copy_s, offload_s=lever.offload_s))
    return cands


def _gather_device(gm: fx.GraphModule) -> torch.device | None:
    sent = [GatherArgs.of(n).shard.meta.get("val") for n in gm.graph.nodes
            if is_call(n, GATHER_OP)]
    return sent[0].device if sent and sent[0] is not None else None


def record_bodies(plan: Plan, region: RegionRecord) -> None:
    """The region's block bodies and inline blocks, in the plan (fields and one note each)."""
    bodies: dict[str, CompiledBody] = {}
    for call in region.body_calls:
        body = bodies.setdefault(call.identifier, CompiledBody(
            call.identifier, call.block_type,
            partitions=region.body_partitions.get(call.identifier, 0)))
        body.blocks.append(call.block)
    plan.bodies = list(bodies.values())
    plan.inline_blocks = [InlineBlock(module, reason) for module, reason in region.inline_blocks]
    for body in plan.bodies:
        plan.notes.append(
            f"block body {body.name} ({body.block_type}): compiled once, called by "
            f"{len(body.blocks)} blocks ({body.blocks[0]} ... {body.blocks[-1]}); joint graph "
            f"partitioned {body.partitions} time(s)")
    for block in plan.inline_blocks:
        plan.notes.append(f"block {block.module} compiled inline: {block.reason}")


def plan_within_budget(fw: fx.GraphModule, bw: fx.GraphModule | None, options: ShardcOptions,
                       region: RegionRecord) -> Plan:
    """Plan, place the buffers in the pool, and while the pool exceeds the memory budget
    (``memory_budget_bytes`` as the pool's size), plan again with shallower prefetch."""
    while True:
        plan = plan_region(fw, bw, options, region=region.index, groups=region.groups)
        assign_pool(plan)
        budget = options.memory_budget_bytes
        if not budget or plan.predicted.pool_bytes <= budget or not options.prefetch:
            return plan
        if options.prefetch_depth <= 1:
            options = replace(options, prefetch=False)
        else:
            options = replace(options, prefetch_depth=options.prefetch_depth - 1)
        plan.notes.append(f"pool {plan.predicted.pool_bytes:.0f} B over budget {budget} B")


def allocate_pool(fw: fx.GraphModule, plan: Plan, options: ShardcOptions,
                  device: torch.device | None = None) -> torch.Tensor | None:
    """The region's communication pool, allocated once and shared by its forward and
    backward (training graphs; forward-only graphs let the compiler place the buffers)."""
    if not options.comm_pool:
        plan.notes.append("communication buffers: allocated per collective (no static pool)")
        return None
    if not plan.predicted.pool_bytes:
        # Every collective is elided (one-rank groups) or found in the graph: no pool, so the
        # compiled graphs take no pool argument either.
        plan.notes.append("communication buffers: none (no collective of shardc's needs one)")
        return None
    # The device of what the gathers send (parameter shards, or an FP8 weight's quantized
    # shard, whose placeholder param_placeholders does not find through the quantization).
    sent = [GatherArgs.of(n).shard.meta["val"] for n in fw.graph.nodes if is_call(n, GATHER_OP)]
    if device is None:
        device = sent[0].device if sent else torch.device("cpu")
    plan.notes.append("communication buffers: views of one static pool")
    return allocate_real(int(plan.predicted.pool_bytes), torch.uint8, device)


def rank_in_plan(plan: Plan) -> int:
    """This process's rank in the plan's shard group."""
    if not plan.group_name or plan.world_size == 1:
        return 0
    return torch.distributed.get_rank(resolve_group(plan.group_name))
