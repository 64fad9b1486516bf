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
   (``shardc.passes.saved_order``), check that no gathered parameter is saved, and let the
   backward's calls of recomputed blocks' forward bodies compute only what the backward reads
   (``shardc.passes.prune_body_outputs``).
5. Plan (``shardc.planning.schedule``): buckets, issue and wait positions, simulation; place the
   buffers in the pool (``shardc.memory.pool``); while the pool exceeds the memory budget, plan
   again with shallower prefetch.
6. Lower (``shardc.passes.lower``): bucketed functional collectives at the planned positions,
   their buffers views of the region's pool.
7. Predict the step's peak memory (``shardc.memory.peak``); dump the plan if asked.

Before step 1, the output projection and cross-entropy may be fused into one chunked op
(``fused_loss``: ``shardc.passes.fused_loss``; forced, or under a budget chosen by
``shardc.compile.fused_loss_choice`` as the search's first lever).

With a whole-step peak budget (``peak_memory_budget_bytes``), :func:`partition_and_plan` first
asks the budget search (:mod:`shardc.compile.budget_search`) which configuration to build: the
search decides (which buckets stay gathered from the forward to the backward,
``shardc.planning.budget``; which blocks are recomputed in the backward,
``shardc.planning.recompute``, tagged after step 3 by ``shardc.passes.recompute``, or have
their saved activations offloaded after step 4, ``shardc.passes.offload_saved``; the prefetch
depth; the optimizer's state on the host), and :func:`search_inputs` hands it a trial that runs
steps 1-7 on a copy of the joint graph for each configuration it tries (steps 1-4 once per
configuration of the partition's levers, steps 5-6 once per depth of it). Then the chosen one is
built, from its trial's partition.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Collection, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from shardc import _torch
from shardc.compile import budget_search, fused_loss_choice, host_memory, progress
from shardc.compile.budget_search import kept_params, with_depth
from shardc.compile.options import ShardcOptions
from shardc.memory.cuda_blocks import sized
from shardc.memory.gc_pause import free_young_garbage
from shardc.memory.host import (
    activation_host_bytes,
    activation_host_values,
    device_copy_bytes,
    find_host_state,
    host_values,
    optimizer_host_bytes,
    resident_host_values,
)
from shardc.memory.peak import param_placeholders, predict_peak, shard_bytes_by_param
from shardc.memory.pool import assign_pool
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.ops.pool import CAST_INTO_OP
from shardc.passes.aliased_saved_values import (
    read_body_views_through_their_base,
    save_one_view_per_storage,
)
from shardc.passes.body import BodyCall
from shardc.passes.body_donations import order_for_body_donations, subgraph_inputs
from shardc.passes.body_operand_layouts import copy_operands_into_traced_layouts
from shardc.passes.body_output_casts import body_output_casts_note, cast_body_outputs_inside
from shardc.passes.body_sizes import recompute_returned_sizes
from shardc.passes.dedupe import dedupe_gathers, merge_reduce_scatters
from shardc.passes.fp8 import Fp8Summary, hoist_fp8_quantize, prepare_fp8
from shardc.passes.fx_utils import allocate_real, copy_graph_module, is_call
from shardc.passes.host_resident import ALREADY_ON_HOST
from shardc.passes.lower import add_pool_placeholder, apply_plan
from shardc.passes.offload_dedupe import dedupe_device_copies
from shardc.passes.offload_saved import (
    OffloadedValue,
    activation_role,
    block_groups,
    offload_saved,
    saved_on_host,
)
from shardc.passes.prune_body_outputs import prune_unused_body_outputs, pruned_body_note
from shardc.passes.recompute import Block, find_blocks, recompute_blocks
from shardc.passes.repeated_body_outputs import read_repeated_outputs_once
from shardc.passes.reshard import check_no_gathered_saved, keep_gathered, tag_resharded_gathers
from shardc.passes.saved_order import order_saved_values
from shardc.passes.sink_residual import SunkBodiesRecomputed
from shardc.planning import optimizer_chunks, optimizer_kind
from shardc.planning.budget import MemoryBudgetError
from shardc.planning.plan import CompiledBody, FusedLossDecision, InlineBlock, MemoryBudget, Plan
from shardc.planning.profile import resolve_profile
from shardc.planning.schedule import device_name, plan_region
from shardc.runtime.collectives import resolve_group
from shardc.sharding.packed_blocks import packed_block_name, packed_fqn

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
    # sink_block_residual (shardc.passes.sink_residual): one plan note per body, sunk or not.
    sink_notes: list[str] = field(default_factory=list, repr=False)
    sunk_bodies: set[str] = field(default_factory=set, repr=False)  # their identifiers
    sink_edits: list = field(default_factory=list, repr=False)  # to undo them (SinkEdits)
    # opaque_body_calls (shardc.passes.body_standin): the later body calls of Dynamo's graph
    # that AOTAutograd traces as stand-ins (a StandIns; None: none).
    stand_ins: object | None = field(default=None, repr=False)
    # Optimizer-only CPU offload (OffloadPolicy(params=False, optimizer=True)): the optimizer's
    # state and step live on the host (shardc.runtime.offload_optimizer), not in the device peak.
    optimizer_on_host: bool = False
    # The peak budget's partial optimizer offload (shardc.planning.optimizer_offload): the
    # parameters whose state and step are on the host (the others' stay on the device); set by
    # an earlier region's decision and while the search tries a subset.
    optimizer_host_params: frozenset[str] = frozenset()
    # The optimizer step in chunks (shardc.planning.optimizer_chunks): the step's foreach
    # temporaries are the largest bucket's; set while the search tries it and when it decides it.
    optimizer_step_chunks: bool = False
    # The host memory the peak budget's search may fill (shardc.compile.host_memory
    # .agree_capacity), agreed across the ranks before it (``host_agreed``); None: no limit.
    host_capacity: host_memory.HostCapacity | None = None
    host_agreed: bool = False
    # CPU offload of the parameters (OffloadPolicy()): the model's key, which the backward's
    # per-bucket "host gradients ready" signals carry (shardc.optim.step_in_backward).
    offload_key: str = ""
    # The fused output projection + cross-entropy (fused_loss): the decision, put in the plan.
    fused_loss: FusedLossDecision | None = None
    # While a region with block bodies compiles under Inductor, AOTAutograd's donated-buffer
    # switch as it was before shardc turned it off, which the partitioner restores where the
    # saved values could be ordered (backend._no_donated_buffers); None otherwise.
    donations_default: bool | None = field(default=None, repr=False)

    @property
    def sunk_block_names(self) -> frozenset[str]:
        """The blocks whose calls run a sunk body (``sink_block_residual``)."""
        return frozenset(c.block for c in self.body_calls if c.identifier in self.sunk_bodies)


# Set by capture_partitioned(): where regions compiled in its scope leave their partitioned graphs.
_PARTITIONED_SINK: ContextVar[list | None] = ContextVar("shardc_partitioned_sink", default=None)


# Whether the budget search's trials share one partition per (kept, recomputed, offloaded)
# configuration, lowering copies of it, and the real build takes the chosen one's instead of
# partitioning again (search_inputs). Off: every trial and the real build partition anew (the
# tests compare the two: tests/test_budget.py).
_SHARE_PARTITIONS = True


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
    # Inductor's joint passes can hand a body call an operand in another layout than its
    # subgraph was traced for (an expanded gradient): copied into the traced one.
    copy_operands_into_traced_layouts(fw)
    copy_operands_into_traced_layouts(bw)
    # The parameters' DeviceMesh is saved for the backward (it builds the DTensor gradients);
    # checkpointed random ops (SDPA, dropout) save RNG states behind it, out of the order
    # AOTAutograd reads saved values in: put them back (shardc/passes/saved_order.py).
    order_saved_values(fw, bw, kwargs["num_fwd_outputs"])
    check_no_gathered_saved(fw, bw)
    # A recomputed block's forward body, called again in the backward, computes only what the
    # backward reads (not the block's output: shardc/passes/prune_body_outputs.py).
    prune_unused_body_outputs(bw)
    # One name per storage for a body output returned at two positions (a sunk body's pair
    # gradient): Inductor may otherwise reuse both names for two outputs of one kernel
    # (shardc/passes/repeated_body_outputs.py).
    read_repeated_outputs_once(fw)
    read_repeated_outputs_once(bw)
    # One saved value per storage where a body returns two views of one tensor (attention's
    # output): the backward views the kept one (shardc/passes/aliased_saved_values.py).
    save_one_view_per_storage(fw, bw, kwargs["num_fwd_outputs"])
    # A body output that views another output of its call, one read here and one saved (the
    # last sunk call's pair sum and its view for a weight's gradient): read as a view of it, so
    # Inductor does not write one's buffer in place while the other is still to be read.
    read_body_views_through_their_base(fw)
    read_body_views_through_their_base(bw)
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
    if budget is not None and budget.host:  # the capacity the host levers were fitted to
        plan.notes.append(budget.host)
    if bw is not None and region.fused_loss is not None:
        plan.fused_loss = region.fused_loss
        plan.notes.append(region.fused_loss.note())
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
    lowered = lower(fw, bw, options, region, pool_device=pool_device)
    return predict(lowered, options, region), lowered.pool


@dataclass
class Lowered:
    """Steps 5-6 done on a region's graphs (:func:`lower`): what the peak prediction
    (:func:`predict`) reads, none of which depends on where the optimizer's state is."""

    fw: fx.GraphModule
    bw: fx.GraphModule | None
    plan: Plan  # not yet predicted
    pool: torch.Tensor | None
    fw_params: set[fx.Node]  # the parameter-shard placeholders, taken before lowering
    bw_params: set[fx.Node]
    host: object  # CPU offload: what lives on the host (find_host_state, before lowering)
    shard_bytes: dict[str, int]  # fw's shard bytes per parameter, before lowering


def lower(fw: fx.GraphModule, bw: fx.GraphModule | None, options: ShardcOptions,
          region: RegionRecord, *, pool_device: torch.device | None = None) -> Lowered:
    """Steps 5-6 of :func:`lower_and_predict` (``fw``/``bw`` changed in place): plan, allocate
    the pool and lower; ``fw``'s shard bytes per parameter are taken before lowering (what
    the prediction reads of the optimizer's placement)."""
    hoist_fp8_quantize(fw)
    hoist_fp8_quantize(bw)
    # AOTAutograd's trace reads a size from a body call's output where the call produced its
    # expression first; Inductor cannot take such an output as a size (shardc/passes/body_sizes).
    for gm in (fw, bw):
        if gm is not None:
            recompute_returned_sizes(gm)
    with progress.stage(region.index, "planning"):
        plan = plan_within_budget(fw, bw, options, region)
    if region.fp8 is not None:
        plan.notes.append(region.fp8.note())
    record_bodies(plan, region)
    fw_params = param_placeholders(fw)
    bw_params = param_placeholders(bw) if bw is not None else set()
    # This rank's shard bytes per parameter, before lowering, in the order the forward gathers
    # them: what the prediction reads of the optimizer's placement (predict).
    by_param = shard_bytes_by_param(fw)
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
                       grads_ready_key=region.offload_key, fusing=options.inductor,
                       one_op=options.one_op_bucket_copies,
                       one_op_casts=options.one_op_local_casts)
    _note_one_op_casts(fw, bw, plan)
    if bw is not None:
        # A one-rank group's gradient casts move into the block bodies that compute them
        # (shardc/passes/body_output_casts.py).
        if cast_body_outputs_inside(bw):
            plan.notes.append(body_output_casts_note(bw))
        _order_donations(fw, bw, plan, _donations_on(region))
    return Lowered(fw, bw, plan, pool, fw_params, bw_params, host, by_param)


def _note_one_op_casts(fw: fx.GraphModule, bw: fx.GraphModule | None, plan: Plan) -> None:
    """A plan note where lowering cast one-rank buckets with one op each
    (``one_op_local_casts``, :func:`shardc.passes.lower.elide`): the elided collectives'
    records say what was not communicated, this says how their casts run."""
    counts = [0 if gm is None else len(gm.graph.find_nodes(op="call_function",
                                                           target=CAST_INTO_OP))
              for gm in (fw, bw)]
    if any(counts):
        plan.notes.append(f"one-rank casts: {counts[0]} forward and {counts[1]} backward "
                          "bucket cast(s) by one shardc::cast_into each, not a cast per "
                          "parameter (one_op_local_casts)")


def _donations_on(region: RegionRecord) -> bool:
    """Whether AOTAutograd's ``donated_buffer`` switch is on for this region's compile as the
    user left it (inside ``backend._no_donated_buffers`` the switch reads off; the region keeps
    the value it found)."""
    if region.donations_default is not None:
        return region.donations_default
    return _torch.donated_buffers_enabled()


def _order_donations(fw: fx.GraphModule, bw: fx.GraphModule, plan: Plan, enabled: bool) -> None:
    """The last step of lowering: the saved values in the order that lets a backward calling
    block bodies keep AOTAutograd's donated buffers (``shardc.passes.body_donations``), with a
    plan note where it calls any; the backend switches the donations on from the stamps.
    ``enabled`` False (the user turned ``donated_buffer`` off): nothing is donated, and the
    stamps say so for the peak model."""
    decision = order_for_body_donations(fw, bw, enabled=enabled)
    if decision is not None and decision.body_inputs:
        plan.notes.append(decision.note())
    elif decision is None and subgraph_inputs(bw):
        plan.notes.append("donated buffers off (block bodies): saved values not in "
                          "AOTAutograd's order")


def predict(lowered: Lowered, options: ShardcOptions, region: RegionRecord) -> Plan:
    """Step 7 of :func:`lower_and_predict` on :func:`lower`'s result, with the optimizer's
    state where ``region`` says (on the host, or of ``region.optimizer_host_params``): the
    peak predicted into ``lowered.plan``, which is returned."""
    fw, bw, plan, pool, host = lowered.fw, lowered.bw, lowered.plan, lowered.pool, lowered.host
    on_host = region.optimizer_on_host
    names = region.optimizer_host_params
    host_stepped = 0 if on_host or not names else \
        sum(n for fqn, n in lowered.shard_bytes.items() if fqn in names)
    allocator, runtime = memory_model(options, fw)
    per_tensor = per_tensor_temps(lowered.shard_bytes, names, options.optimizer_state_factor,
                                  sized(allocator))
    chunk_bytes = largest_chunk(plan, lowered.shard_bytes, sized(allocator)) \
        if region.optimizer_step_chunks and not on_host else None
    with progress.stage(region.index, "peak prediction"):
        predict_peak(fw, bw, plan, lowered.fw_params, lowered.bw_params,
                     optimizer_state_factor=0.0 if on_host else options.optimizer_state_factor,
                     optimizer_temp_factor=0.0 if on_host else options.optimizer_temp_factor,
                     persistent_bytes=pool.numel() if pool is not None else 0,
                     fusion=options.inductor,
                     host=host.params | host.bw_params | host_values(fw) | host_values(bw)
                     | activation_host_values(fw, bw) | resident_host_values(fw, bw),
                     optimizer_host_param_bytes=host_stepped,
                     optimizer_impl=options.optimizer_impl,
                     optimizer_per_tensor_bytes=per_tensor,
                     optimizer_chunk_bytes=chunk_bytes,
                     allocator=allocator, runtime_bytes=runtime)
        note_optimizer_impl(plan, options, host_stepped > 0, on_host)
        record_host_bytes(plan, host, fw, options, on_host)
    return plan


def largest_chunk(plan: Plan, shard_bytes: dict[str, int], count=int) -> int:
    """This rank's bytes of shards in the optimizer step's largest chunk
    (``shardc.planning.optimizer_chunks.chunks`` of the plan's buckets; ``count``: a shard's
    counted bytes from its requested ones, each a separate allocation)."""
    parts = optimizer_chunks.chunks(plan.buckets, shard_bytes)
    return optimizer_chunks.largest_chunk_bytes(parts, lambda p: count(shard_bytes.get(p, 0)))


def per_tensor_temps(shard_bytes: dict[str, int], host_names: frozenset[str],
                     state_factor: float, count=int) -> int:
    """The per-tensor optimizer's device temporaries over this rank's shards (``shard_bytes``:
    bytes per parameter, before lowering, in the order the forward gathers them), those in
    ``host_names`` stepped on the host (``optimizer_kind.per_tensor_temp_bytes``); ``count``:
    a temporary's counted bytes from its requested ones (each is a shard-sized allocation)."""
    return optimizer_kind.per_tensor_temp_bytes(
        (None if fqn in host_names else count(n) for fqn, n in shard_bytes.items()),
        state_factor)


def memory_model(options: ShardcOptions, fw: fx.GraphModule) -> tuple[str, int]:
    """How the peak model counts this region's device memory: the allocator
    (``shardc.memory.cuda_blocks.ALLOCATORS``) and the runtime's bytes added to every phase.
    Decided once from the plan's target: ``options.memory_target``, where ``"auto"`` is the
    CUDA count when any input of the forward is on a CUDA device (its parameter shards; a
    host master under CPU offload is not), or when ``options.cluster`` names a profile whose
    device is no CPU (a plan made on a CPU for that GPU); else (a CPU mesh with the default
    profile: tests, CPU runs) the requested bytes. The CUDA count's workspaces come from the
    cluster profile the cost model uses (``ClusterProfile.runtime_bytes``)."""
    target = options.memory_target
    if target == "exact":
        return "exact", 0
    profile = resolve_profile(options.cluster, device_name(fw))
    if target == "auto" and not _on_cuda(fw) and not (
            _names_profile(options.cluster) and not profile.on_cpu):
        return "exact", 0
    return "cuda", profile.runtime_bytes()


def _names_profile(cluster: dict | None) -> bool:
    """Whether the ``cluster`` option names a profile (a preset, a file, or a whole profile),
    rather than leaving the default or giving flat rates only."""
    return bool(cluster) and ("profile" in cluster or "format" in cluster)


def _on_cuda(gm: fx.GraphModule) -> bool:
    return any(isinstance(v := n.meta.get("val"), torch.Tensor) and v.device.type == "cuda"
               for n in gm.graph.find_nodes(op="placeholder"))


def note_optimizer_impl(plan: Plan, options: ShardcOptions, mixed: bool, on_host: bool) -> None:
    """Say in the plan's notes which implementation the optimizer step's temporaries are
    predicted for, where ``"auto"`` does not run foreach on the device (a mixed group)."""
    if on_host:
        return
    ran = optimizer_kind.ran(options.optimizer_impl, options.optimizer_temp_factor,
                             host_in_group=mixed)
    if mixed or options.optimizer_impl != "auto":
        plan.notes.append(
            f"optimizer step predicted as torch.optim's {optimizer_kind.describe(ran, mixed=mixed)}"
            f" implementation (optimizer_impl={options.optimizer_impl!r}): "
            f"{(plan.predicted.optimizer_temp_bytes or 0) / 2**20:.1f} MiB of device "
            "temporaries")


def record_host_bytes(plan: Plan, host, fw: fx.GraphModule, options: ShardcOptions,
                      on_host: bool) -> None:
    """``plan.predicted.host_bytes``: CPU offload's masters, gradients and optimizer state (or,
    optimizer-only, the host masters, their gradients and state, of every parameter or of
    those the peak budget chose), plus the saved activations the forward offloads;
    ``device_copy_bytes`` where there are copies."""
    total, known = 0.0, False
    partial = plan.predicted.optimizer_host_param_bytes
    if any(c.origin == "shardc" for c in plan.copies):
        total, known = float(host.host_bytes(options.optimizer_state_factor)), True
    elif on_host or partial:
        stepped = plan.predicted.param_bytes if on_host else partial
        total, known = float(optimizer_host_bytes(
            stepped or 0.0, options.optimizer_state_factor)), True
    activations = activation_host_bytes(fw)
    if known or activations:
        plan.predicted.host_bytes = total + activations
    if plan.copies:
        plan.predicted.device_copy_bytes = float(device_copy_bytes(plan))


def _refuse_recomputed_sunk_bodies(recomputed: Collection[str], options: ShardcOptions,
                                   region: RegionRecord,
                                   refused: Exception | None = None) -> None:
    """``sink_block_residual="auto"``: raise :class:`SunkBodiesRecomputed` where the budget's
    choice (or, ``refused``, its refusal's minimum) recomputes a whole block whose body is sunk
    (its checkpoint would be both addends). A part of a sunk block's saved values recomputes
    as in any body (``recomputed`` names it ``<block>#...``; it is not refused). The backend
    compiles the region again without sinking. The choice is the same on every rank, so every
    rank raises alike."""
    if options.sink_block_residual != "auto" or not region.sunk_bodies:
        return
    hit = sorted(region.sunk_block_names.intersection(recomputed))
    if hit:
        raise SunkBodiesRecomputed(hit) from refused


def partition_and_plan(gm: fx.GraphModule, joint_inputs: Sequence[object], options: ShardcOptions,
                       region: RegionRecord, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Steps 1-7 on a training region's joint graph; returns the planned forward and backward.

    With a peak budget (``peak_memory_budget_bytes``) the budget search
    (:mod:`shardc.compile.budget_search`) first evaluates configurations on copies of the joint
    graph (each built by :func:`search_inputs`'s trial: partitioned, planned and predicted),
    then the chosen one is built for real. Without one, this is the fixed policy, unchanged."""
    decided, inputs = None, None
    region.fused_loss = None
    agree_host_capacity(gm, options, region)
    if options.fused_loss_forced():
        region.fused_loss = fused_loss_choice.forced(gm, options)
    if options.peak_memory_budget_bytes:
        with progress.stage(region.index, "peak budget"):
            if options.fused_loss == "auto":
                region.fused_loss, inputs = fused_loss_choice.choose(
                    gm, options, region,
                    lambda graph: search_inputs(graph, joint_inputs, options, region, kwargs))
            else:
                inputs = search_inputs(gm, joint_inputs, options, region, kwargs)
            try:
                decided = budget_search.choose_under_budget(inputs, options, region)
            except MemoryBudgetError as refused:
                # The minimum it names recomputes the sunk blocks with the pair as their
                # checkpoints: the graph as traced may fit, and names its own minimum.
                _refuse_recomputed_sunk_bodies(region.sunk_block_names, options, region,
                                               refused)
                raise
        _refuse_recomputed_sunk_bodies(decided.recomputed, options, region)
    # A block both recomputed and offloaded: recomputed, its checkpoint offloaded.
    recomputed = set(decided.recomputed) if decided is not None else set()
    offloaded = (set(decided.offloaded) | set(decided.checkpoint_offloaded)
                 if decided is not None else set(options.forced_offload()))
    forced_checkpoints = set(options.forced_checkpoint_offload()) if decided is None else set()
    # The chosen configuration's partition, as a trial made it (the same steps on a copy of
    # the same joint graph), unless the caller wants the partitioned graphs themselves.
    start = time.perf_counter()
    reused = (inputs.take_partition(kept_params(decided), recomputed, offloaded)
              if inputs is not None and _PARTITIONED_SINK.get() is None else None)
    if reused is not None:
        progress.log_stage(region.index, "joint passes + partition", time.perf_counter() - start)
        region.fp8, fw, bw = reused
        blocks, done = [], []
    else:
        if decided is not None:
            keep_gathered(gm.graph, kept_params(decided))
        with progress.stage(region.index, "joint passes + partition"):
            region.fp8 = joint_passes(gm.graph)
            blocks = (region_blocks(gm, region, kwargs)
                      if recomputed or offloaded or forced_checkpoints else [])
            if forced_checkpoints:  # recomputed, their checkpoints offloaded
                checkpointed = {b.name for b in blocks if not b.excluded and (
                    "*" in forced_checkpoints or b.name in forced_checkpoints)}
                recomputed |= checkpointed
                offloaded |= checkpointed
            if recomputed:
                recompute_blocks(gm, blocks, recomputed)
            gm.recompile()
            fw, bw = partition(gm, joint_inputs, **kwargs)
        done = offload_activations(fw, bw, kwargs["num_fwd_outputs"], blocks, offloaded,
                                   recomputed)
    if decided is not None and decided.prefetch is not None:
        options = with_depth(options, decided.prefetch.depth)
    plan = plan_and_lower(fw, bw, options, region, budget=decided)
    # The final safety net (the search fitted its host levers to the same agreed capacity).
    host_memory.refuse_overcommit(
        plan, activation_host_bytes(fw), _planner_optimizer_bytes(plan, region, options),
        options.check_host_memory, region.check_index,
        offloads=_offloads_activations(fw) or _planner_optimizer(region),
        capacity=region.host_capacity if region.host_agreed else None)
    pruned = pruned_body_note(bw)
    if pruned:
        plan.notes.append(pruned)
    if forced_checkpoints:
        plan.notes.append(forced_checkpoint_note(done, blocks, forced_checkpoints, recomputed))
    plain = set(options.forced_offload())
    if plain and decided is None:
        left = left_on_host(fw, kwargs["num_fwd_outputs"], blocks, plain)
        plan.notes.append(forced_offload_note([v for v in done if v.group not in recomputed],
                                              blocks, plain, left))
    return fw, bw


def agree_host_capacity(gm: fx.GraphModule, options: ShardcOptions,
                        region: RegionRecord) -> None:
    """Before the peak budget's search, once per region: the host memory it may fill
    (``region.host_capacity``), agreed across the group's ranks
    (``host_memory.agree_capacity``), so that every rank chooses the same host levers. Only
    where the search may choose one (``host_memory.host_levers_possible``, which the options
    alone decide: every rank exchanges or none does); otherwise no limit and no exchange."""
    region.host_capacity, region.host_agreed = None, False
    if not host_memory.host_levers_possible(options):
        return
    gathers = (n for n in gm.graph.nodes if is_call(n, GATHER_OP))
    first = next(gathers, None)
    group = GatherArgs.of(first).group_name if first is not None else ""
    region.host_capacity = host_memory.agree_capacity(group, region.check_index)
    region.host_agreed = True


def _offloads_activations(fw: fx.GraphModule) -> bool:
    """Whether the forward copies saved activations to the host (a decision: the same graph
    structure on every rank)."""
    return any(activation_role(n) == "d2h" for n in fw.graph.nodes)


def _planner_optimizer(region: RegionRecord) -> bool:
    """Whether the peak budget put part of the optimizer on the host (not the user's
    ``OffloadPolicy``, which puts all of it there and is checked at ``shardc.shard``)."""
    return bool(region.optimizer_host_params) and not region.optimizer_on_host


def _planner_optimizer_bytes(plan: Plan, region: RegionRecord, options: ShardcOptions) -> int:
    """Host bytes of the optimizer's share the peak budget put on the host (0 where it put none,
    or where the user's ``OffloadPolicy`` put all of it there)."""
    if not _planner_optimizer(region):
        return 0
    return optimizer_host_bytes(plan.predicted.optimizer_host_param_bytes or 0.0,
                                options.optimizer_state_factor)


def search_inputs(gm: fx.GraphModule, joint_inputs: Sequence[object], options: ShardcOptions,
                  region: RegionRecord, kwargs: dict) -> budget_search.SearchInputs:
    """What the budget search needs of a training region's joint graph ``gm`` (left unchanged):
    a copy of it; the trial that builds one configuration of it, steps 1-7 on another copy
    (kept gathers, joint passes, recomputed blocks, partition, offloaded activations, plan,
    lower, predict; the pool on the meta device, no dump, not handed to the partitioned-graph
    sink); the blocks found on the joint passes' graph; and the chosen configuration's
    partition for the real build (``take_partition``).

    A trial shares what does not depend on all of its key (``docs/memory_budget.md``): one
    partition per (kept, recomputed, offloaded), which the trials lower copies of, and one
    lowering per (kept, recomputed, offloaded, depth), which another optimizer placement only
    predicts again. ``_SHARE_PARTITIONS`` off: each trial partitions and lowers anew."""
    pristine = copy_graph_module(gm)
    # The trials' dumps and plan-only stops belong to the real plan only.
    trial_options = replace(options, dump_dir=None)
    # (kept, recomputed, offloaded) -> the FP8 summary and the partitioned graphs (steps 1-4
    # and the activation offload, not yet planned): the same for every prefetch depth and
    # optimizer placement, which only planning, lowering and the prediction read.
    partitions: dict[tuple[frozenset[str], ...], tuple] = {}

    def partitioned(kept: Collection[str], recomputed: Collection[str],
                    offloaded: Collection[str]) -> tuple:
        key = (frozenset(kept), frozenset(recomputed), frozenset(offloaded))
        if key in partitions:
            return partitions[key]
        joint = copy_graph_module(pristine)
        keep_gathered(joint.graph, key[0])
        fp8 = joint_passes(joint.graph)
        found = region_blocks(joint, region, kwargs) if recomputed or offloaded else []
        if recomputed:
            recompute_blocks(joint, found, set(key[1]))
        joint.recompile()
        fw, bw = partition(joint, joint_inputs, record=False, **kwargs)
        offload_activations(fw, bw, kwargs["num_fwd_outputs"], found, set(key[2]), set(key[1]))
        if _SHARE_PARTITIONS:
            partitions[key] = (fp8, fw, bw)
        return fp8, fw, bw

    # (kept, recomputed, offloaded, depth) -> the lowered copy of that partition and its plan's
    # predictions before the peak prediction: the same for every optimizer placement, which
    # only the prediction reads (lower, predict).
    lowerings: dict[tuple, tuple[Lowered, object, object, list[str]]] = {}

    def trial(kept: Collection[str], recomputed: Collection[str], offloaded: Collection[str],
              depth: int) -> Plan:
        # The region compiles with the collector held off: each trial's garbage goes now,
        # not at the end of the search (shardc.memory.gc_pause).
        try:
            return _trial(kept, recomputed, offloaded, depth)
        finally:
            free_young_garbage()

    def _trial(kept: Collection[str], recomputed: Collection[str], offloaded: Collection[str],
               depth: int) -> Plan:
        _, fw, bw = partitioned(kept, recomputed, offloaded)
        trial_at_depth = with_depth(trial_options, depth)
        meta = torch.device("meta")
        if not _SHARE_PARTITIONS:
            return lower_and_predict(fw, bw, trial_at_depth, region, pool_device=meta)[0]
        key = (frozenset(kept), frozenset(recomputed), frozenset(offloaded), depth)
        if key not in lowerings:
            # Lowered on copies: the partition stays as it was made, for the next trial of it
            # and for the real build (take_partition).
            lowered = lower(copy_graph_module(fw), copy_graph_module(bw), trial_at_depth,
                            region, pool_device=meta)
            # What the prediction writes (its predictions, memory by category, notes: the
            # optimizer implementation's), as they were before it.
            lowerings[key] = (lowered, copy.deepcopy(lowered.plan.predicted),
                              copy.deepcopy(lowered.plan.memory_by_category),
                              list(lowered.plan.notes))
            return predict(lowered, trial_at_depth, region)
        # Another optimizer placement of a configuration lowered already: its plan (the
        # predictions as they were before the peak prediction) predicted again.
        lowered, predicted, by_category, notes = lowerings[key]
        plan = copy.copy(lowered.plan)
        plan.predicted, plan.memory_by_category = (copy.deepcopy(predicted),
                                                   copy.deepcopy(by_category))
        plan.notes = list(notes)
        return predict(replace(lowered, plan=plan), trial_at_depth, region)

    def take_partition(kept: Collection[str], recomputed: Collection[str],
                       offloaded: Collection[str]) -> tuple | None:
        """The partition a trial made of this configuration (its FP8 summary, forward and
        backward), handed over once (the trials' others dropped), or None if none did."""
        key = (frozenset(kept), frozenset(recomputed), frozenset(offloaded))
        found = partitions.pop(key, None)
        partitions.clear()
        lowerings.clear()
        return found

    probe = copy_graph_module(pristine)  # the joint passes' graph, where blocks are found
    joint_passes(probe.graph)
    return budget_search.SearchInputs(pristine, trial, probe,
                                      region_blocks(probe, region, kwargs), take_partition)


def offload_activations(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                        blocks: Sequence[Block], names: set[str],
                        recomputed: Collection[str] = ()) -> list[OffloadedValue]:
    """Offload the saved activations of the blocks named ``names`` (``"*"``: all) from the
    partitioned graphs (``shardc.passes.offload_saved``), before they are planned; of those
    also ``recomputed``, their checkpoints (``block_groups``)."""
    if not names:
        return []
    return offload_saved(fw, bw, num_fwd_outputs,
                         block_groups(fw, num_fwd_outputs, blocks, names, recomputed))


def left_on_host(fw: fx.GraphModule, num_fwd_outputs: int, blocks: Sequence[Block],
                 names: set[str]) -> list[str]:
    """The saved values of the blocks named ``names`` (``"*"``: every saved value) that
    activation offload left where they are, already on the host
    (``shardc.passes.offload_saved.saved_on_host``)."""
    members = {n.name for b in blocks if "*" in names or b.name in names for n in b.nodes}
    return [n.name for n in saved_on_host(fw, num_fwd_outputs)
            if "*" in names or n.name in members]


def _unmatched_names(names: set[str], blocks: Sequence[Block]) -> str:
    """The tail of a forced-offload note: the names that are no block of this region, or that
    the region has no blocks at all."""
    here = {b.name for b in blocks}
    absent = sorted(n for n in names if n != "*" and n not in here)
    return ((f"; named but not blocks of this region: {absent}" if absent else "")
            + ("; this region has no blocks (the children with parameters of an "
               "nn.ModuleList of two or more, shardc.sharding.blocks)" if not blocks else ""))


def forced_offload_note(done: list[OffloadedValue], blocks: Sequence[Block],
                        names: set[str], left: Sequence[str] = ()) -> str:
    """The plan's note on a forced activation offload (``activation_offload=(blocks...)``);
    ``left``: the named blocks' saved values not offloaded, already on the host."""
    found = sorted({v.group for v in done})
    nbytes = sum(v.nbytes for v in done)
    return (f"activation offload (activation_offload): {len(done)} saved value(s) of "
            f"{len(found)} block(s) {found} copied to the host in the forward and prefetched "
            f"for the backward ({nbytes} B)"
            + (f"; {len(left)} saved value(s) not offloaded, {ALREADY_ON_HOST}: {list(left)}"
               if left else "")
            + _unmatched_names(names, blocks))


def forced_checkpoint_note(done: list[OffloadedValue], blocks: Sequence[Block],
                           names: set[str], recomputed: set[str]) -> str:
    """The plan's note on forced checkpoint offload (``activation_offload``'s
    ``"checkpoint:<block>"`` entries): the blocks recomputed, their checkpoints offloaded."""
    here = {b.name: b for b in blocks}
    chosen = sorted(n for n in recomputed if n in here)
    values = [v for v in done if v.group in recomputed]
    never = sorted(f"{n} ({here[n].excluded})" for n in names if n in here and here[n].excluded)
    return (f"checkpoint offload (activation_offload 'checkpoint:'): {len(chosen)} block(s) "
            f"{chosen} recomputed in the backward, {len(values)} saved value(s) of their "
            f"checkpoints {sorted(v.name for v in values)} copied to the host in the forward "
            f"and prefetched for the backward ({sum(v.nbytes for v in values)} B)"
            + (f"; never recomputed, left as they were: {never}" if never else "")
            + _unmatched_names(names, blocks))


def region_blocks(gm: fx.GraphModule, region: RegionRecord, kwargs: dict) -> list[Block]:
    """The blocks of a region's joint graph (after the joint passes): its compile-once body
    calls and its inline blocks (``shardc.passes.recompute.find_blocks``)."""
    return find_blocks(gm, kwargs["num_fwd_outputs"], [c.block for c in region.body_calls],
                       [module for module, _ in region.inline_blocks])


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
    packed = sorted({b for c in plan.collectives for p in c.params
                     if (b := packed_block_name(p)) is not None})
    if packed:
        plan.notes.append(
            f"packed blocks (pack_blocks=True): {len(packed)} block(s) ({packed[0]} ... "
            f"{packed[-1]}) each read and gathered as one buffer of its parameters' shards "
            f"('{packed_fqn('<block>')}'), one all-gather and one reduce-scatter per block")
    plan.notes.extend(region.sink_notes)


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
