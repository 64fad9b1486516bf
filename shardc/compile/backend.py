"""The ``shardc`` torch.compile backend: the Dynamo, AOTAutograd and Inductor wiring.

Dynamo hands over a forward graph in which every sharded parameter is read through
``shardc::gather_param``. AOTAutograd traces forward and backward together and calls shardc's
partitioner (:class:`ShardcPartitioner`), which runs the pipeline
(:mod:`shardc.compile.pipeline`: joint passes, partition, plan, lower). Inductor (or, with
``inductor=False``, plain FX) compiles the planned graphs. Everything here is about fitting the
pipeline into torch.compile's hooks; what shardc does to a graph is in the pipeline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from shardc import _torch
from shardc.compile import cudagraphs, pipeline, progress, warm
from shardc.compile.options import ShardcOptions
from shardc.compile.param_offload import host_example_inputs
from shardc.compile.pipeline import RegionRecord, capture_partitioned
from shardc.memory.gc_pause import collector_paused
from shardc.ops.body_standin import BODY_BWD_OP, BODY_FWD_OP
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.body import (
    describe_body_calls,
    draws_random_numbers,
    inline_body_calls,
    input_signature,
    is_body_joint,
    rewire_saved_inputs,
    rewrite_trace_once_calls,
    tag_lazy_bit_views_recompute,
    tag_weight_recompute,
)
from shardc.passes.body_donations import DONATED
from shardc.passes.body_rng import unwrap_drawless_ops
from shardc.passes.body_share import share_equal_bodies
from shardc.passes.body_sizes import recompute_returned_sizes
from shardc.passes.body_standin import (
    StandInMismatch,
    restore_body_calls,
    stand_in_later_calls,
    undo_stand_ins,
)
from shardc.passes.fused_loss import LOSS_OPS, decompose_whole_loss_ops
from shardc.passes.fx_utils import is_call
from shardc.passes.lower import POOL_PLACEHOLDER
from shardc.passes.offload_unplaced import drop_offload_copies
from shardc.passes.sink_residual import (
    SunkBodiesRecomputed,
    sink_block_residuals,
    tie_pair_tangents,
    unsink,
)
from shardc.passes.to_local import plain_to_local_calls
from shardc.planning import optimizer_chunks
from shardc.planning.budget import MemoryBudgetError
from shardc.planning.plan import Plan
from shardc.runtime import chunked_step, offload_optimizer
from shardc.runtime.comm_errors import boxed_with_collective_errors, guard_inductor_graph
from shardc.runtime.plan_check import announce_region, check_plan_consistency
from shardc.sharding import auto_offload, packed_blocks
from shardc.sharding.shard import ShardState, state_for_key

__all__ = ["RegionRecord", "ShardcPartitioner", "backend", "capture_partitioned",
           "has_sharded_params", "sharded_gathers", "shardc_backend", "source_hash"]

log = logging.getLogger("shardc")

_SOURCE_ROOT = Path(__file__).resolve().parent.parent  # the shardc package


def sharded_gathers(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """shardc's gather nodes in ``gm`` and in the subgraphs of its higher-order ops: a weight
    gathered in FP8 is gathered inside a ``torch.autograd.Function``, which Dynamo traces into a
    subgraph (AOTAutograd inlines it later), so a region whose only sharded parameters are FP8
    weights has no gather at its top level."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from (n for n in module.graph.nodes if is_call(n, GATHER_OP))


def has_sharded_params(gm: fx.GraphModule) -> bool:
    return next(sharded_gathers(gm), None) is not None


@functools.cache
def source_hash() -> str:
    """sha256 over shardc's ``*.py`` files (keys compile caches; identifies measured code)."""
    digest = hashlib.sha256()
    for path in sorted(_SOURCE_ROOT.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class ShardcPartitioner(_torch.custom_partitioner_base()):
    """Inductor's custom partitioner hook (and AOTAutograd's ``partition_fn``): the pipeline
    for one region's joint graph, and for its forward-only graphs."""

    def __init__(self, options: ShardcOptions, region: RegionRecord,
                 clock: progress.Stopwatch | None = None,
                 state: ShardState | None = None) -> None:
        self.options = options
        self.region = region
        # A model whose shards the planner may move to the host (OffloadPolicy(params="auto")):
        # its graphs' offload copies are dropped while the shards are on the device.
        self.unplaced = auto_offload.unplaced(state)
        self.state = state
        self.clock = clock or progress.Stopwatch()  # since the backend was entered
        # Compile caches key DTensor inputs by their global shape, but the compiled graphs hold
        # this rank's local shard shapes (uneven across ranks): key the cache by rank too.
        dist = torch.distributed
        self.rank_key = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        if is_body_joint(gm):
            return self.partition_body(gm, joint_inputs, **kwargs)
        index = self.region.index
        progress.log_stage(index, "AOTAutograd joint graph", self.clock.lap())
        if self.region.stand_ins:
            # Later body calls traced as stand-ins (opaque_body_calls): the calls of the first
            # call's partitioned body again, as torch would have built them.
            restored = restore_body_calls(gm)
            log.debug("shardc: region %d: %d body call stand-ins restored", index, restored)
        # Saved weights that body calls return read the gathers instead, which the reshard
        # pass then recomputes in the backward.
        rewire_saved_inputs(gm, duplicates=self.options.sinks_residuals())
        self._drop_unplaced_copies(gm)
        try:
            fw, bw = pipeline.partition_and_plan(gm, joint_inputs, self.options, self.region,
                                                 **kwargs)
        except MemoryBudgetError as refused:
            if self.unplaced:  # the last lever: the shards to the host (the backend moves them)
                auto_offload.choose(self.state, refused)
            raise
        _switch_donations(self.region, bw)
        # AOTAutograd's cache entry pickles this backward; a hit must load no tensor constant.
        warm.retrace_on_reload(bw)
        self.clock.lap()
        return fw, bw

    def partition_body(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        """A block body's joint graph (AOTAutograd partitions each distinct body once, before
        the region): no collectives, nothing to plan; only its weights must not be saved in
        any other form than themselves (:func:`shardc.passes.body.tag_weight_recompute`)."""
        primals = [p for p in gm.graph.find_nodes(op="placeholder")
                   if not p.name.startswith("tangents")]
        signature = input_signature([p.meta.get("val") for p in primals])
        matches = [c for c in self.region.body_calls if c.inputs == signature]
        if matches:
            weights = set.intersection(*(set(c.weights) for c in matches))
            tagged = tag_weight_recompute(gm, weights)
            name = matches[0].identifier
            if name in self.region.sunk_bodies:
                tie_pair_tangents(gm)
            self.region.body_partitions[name] = self.region.body_partitions.get(name, 0) + 1
            log.debug("shardc: partitioning the body %s of %s (%d weight inputs, %d nodes "
                      "recomputed from them)", name, matches[0].block_type, len(weights), tagged)
        elif self.region.body_calls:
            log.warning("shardc: a body's joint graph matches no body call of region %d; its "
                        "weights are not identified", self.region.index)
        tag_lazy_bit_views_recompute(gm)
        fw, bw = _torch.min_cut_partition(gm, joint_inputs, **kwargs)
        # Checkpointed attention without dropout: no generator state saved and restored (nor,
        # on CUDA, threaded through the region) for a recompute that draws nothing.
        unwrapped = unwrap_drawless_ops(fw, bw)
        if unwrapped:
            log.debug("shardc: %d recomputed op(s) of a body drawing no random numbers run "
                      "without torch's generator-state wrappers", unwrapped)
        return fw, bw

    def plan_inference(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Plan a forward-only graph (``torch.no_grad()`` / eval): gathers only, no reductions."""
        if self.region.stand_ins and any(
                n.op == "call_function" and n.target in (BODY_FWD_OP, BODY_BWD_OP)
                for n in gm.graph.nodes):
            raise StandInMismatch("AOTAutograd traced the region without autograd")
        if has_sharded_params(gm):
            index = self.region.index
            progress.log_stage(index, "AOTAutograd forward graph", self.clock.lap())
            self._drop_unplaced_copies(gm)
            with progress.stage(index, "joint passes"):
                if self.options.keeps_loss_ops_whole():  # kept whole for the fused loss
                    decompose_whole_loss_ops(gm)
                self.region.fp8 = pipeline.joint_passes(gm.graph, training=False)
                gm.recompile()
            pipeline.plan_and_lower(gm, None, self.options, self.region)
            self.clock.lap()
        return gm

    def _drop_unplaced_copies(self, gm: fx.GraphModule) -> None:
        if self.unplaced and drop_offload_copies(gm.graph):
            gm.recompile()

    def uuid(self) -> str:
        options = sorted(self.options.as_dict().items())
        # Shards the planner may still move: the same joint graph is partitioned without the
        # offload copies (on a CPU mesh simulating offload, the inputs do not tell).
        unplaced = "-unplaced" if self.unplaced else ""
        return f"shardc-{source_hash()}-{options}-rank{self.rank_key}{unplaced}"

    def __reduce__(self):
        # Inductor's FX graph cache pickles its whole config into the key, this object included
        # (torch 2.11-2.13 hash its uuid() as well but do not leave the object out). Pickled as
        # itself it would carry the region's live state (graphs that Inductor mutates while it
        # compiles, the plan, the pool), so a second process computed another key and missed.
        # What decides the compiled code is the uuid; a pickled partitioner is only that.
        return (PartitionerKey, (self.uuid(),))


@dataclasses.dataclass(frozen=True)
class PartitionerKey:
    """What a pickled :class:`ShardcPartitioner` becomes: its :meth:`~ShardcPartitioner.uuid`
    (compile caches key on it; a partitioner is never sent to another process to run)."""

    uuid: str


def _checked(compiled, region: RegionRecord, options: ShardcOptions):
    """Wrap a compiled region so its first call compares plans across ranks."""

    def run(*args):
        if not region.checked:
            region.checked = True
            if region.check_index is not None and region.plan is not None:
                check_plan_consistency(region.plan, region.check_index)
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _shard_state(gm: fx.GraphModule) -> ShardState | None:
    """The :class:`ShardState` of the sharded model whose parameters ``gm`` gathers, found through
    the model key every gather carries as a constant (``sync_key``), or None (a model that is
    gone). Nothing is looked up on parameter objects: ``nn.Module._apply`` swaps them."""
    for gather in sharded_gathers(gm):
        key = GatherArgs.of(gather).sync_key
        state = state_for_key(key) if key else None
        if state is not None:
            return state
    return None


def _inductor_with_pool(compile_inner, graph: fx.GraphModule, inputs, region: RegionRecord,
                        kw: dict):
    """Compile ``graph`` with Inductor; a failing collective is re-raised naming it (looked up
    only after a failure, see ``comm_errors.guard_inductor_graph``). If the graph takes the
    communication pool as an input (:func:`add_pool_placeholder`), the returned callable inserts
    the region's pool into the arguments AOTAutograd passes (which do not include it)."""
    _torch.forget_mesh_hashes(inputs)  # else the FX graph cache misses in a new process
    placeholders = graph.graph.find_nodes(op="placeholder")
    names = [p.name for p in placeholders]
    if POOL_PLACEHOLDER not in names:
        return guard_inductor_graph(compile_inner(graph, inputs, **kw), graph,
                                    lambda: region.plan)
    index = names.index(POOL_PLACEHOLDER)
    inputs = list(inputs)
    if len(inputs) < len(placeholders):
        inputs.insert(index, placeholders[index].meta["val"])
    static = list(kw.get("static_input_idxs") or ())
    if static and len(static) == len(set(static)) and index not in static:
        # The pool never moves: a static input (for CUDA graphs too). Indices after it shift.
        static = sorted([i + (i >= index) for i in static] + [index])
        kw["static_input_idxs"] = static
    compiled = guard_inductor_graph(compile_inner(graph, inputs, **kw), graph,
                                    lambda: region.plan)
    pool = region.pool

    def run(args):
        args.insert(index, pool)
        return compiled(args)

    run._boxed_call = True
    return run


def _fx_compiler(gm: fx.GraphModule, example_inputs: Sequence[object], *,
                 region: RegionRecord):
    # Boxed like make_boxed_func; a failing collective is re-raised naming it (no per-step cost).
    return boxed_with_collective_errors(gm, lambda: region.plan)


def _compile_unsharded(gm: fx.GraphModule, example_inputs, options: ShardcOptions):
    log.info("shardc: this graph reads no sharded parameter; compiling it like the default backend")
    if options.inductor:
        compile_fx, _ = _torch.inductor_compilers()
        return compile_fx(gm, example_inputs)
    return gm.forward


def _body_of(call: fx.Node) -> fx.GraphModule:
    return getattr(call.graph.owning_module, call.args[0].target)


_SELECTIVE = ("it runs under selective activation checkpointing (a context_fn policy), which "
              "a shared body's partition does not follow")
_RANDOM = ("it draws random numbers (dropout), which a shared body would not replay when "
           "activation checkpointing recomputes it")


@dataclasses.dataclass(frozen=True)
class _BodyRandomness:
    """What a body's random ops mean for sharing it. ``draws``: it draws random numbers;
    ``checkpointed``: it draws them inside an activation-checkpointed region of its own.
    Checkpointed ops that torch counts as random but that draw nothing (attention without
    dropout) keep the body, under Inductor too: its partition drops the generator state torch
    saves for them (:func:`shardc.passes.body_rng.unwrap_drawless_ops`)."""

    draws: bool
    checkpointed: bool

    def reason(self, around: bool) -> str | None:
        """Why a call of the body must compile inline, or None; ``around``: the call itself
        runs inside another higher-order op's subgraph (activation checkpointing around the
        block: the user's, or transformers' gradient checkpointing), which recomputes it.
        A call nothing recomputes keeps the body: each call draws its own numbers, and its
        backward reads the masks its forward saved (the partitioners never recompute a random
        op, and shardc's recompute lever refuses such a body)."""
        if self.checkpointed or (around and self.draws):
            return _RANDOM
        return None


def _inline_unsupported(gm: fx.GraphModule, found: list, blocks, region: RegionRecord) -> list:
    """Inline the body calls that a shared body would run wrongly (random ops) or against the
    user's policy (selective checkpointing); returns the other calls."""
    unsupported = []
    random: dict[int, _BodyRandomness] = {}  # per body: the blocks of a group call the same one
    for node, call in found:
        body = _body_of(node)
        if id(body) not in random:
            random[id(body)] = _BodyRandomness(
                draws_random_numbers(body), draws_random_numbers(body, checkpointed=True))
        reason = random[id(body)].reason(around=node.graph is not gm.graph)
        if _torch.selective_checkpoint_policy(node.graph.owning_module) is not None:
            unsupported.append((node, call, _SELECTIVE))
        elif reason is not None:
            unsupported.append((node, call, reason))
    if not unsupported:
        return found
    inline_body_calls(gm, [node for node, _, _ in unsupported])
    for _, call, reason in unsupported:
        region.inline_blocks.append((call.block, reason))
        blocks.report_inline(call.block, reason)
    inlined = {id(node) for node, _, _ in unsupported}
    return [(node, call) for node, call in found if id(node) not in inlined]


def _sink_residuals(gm: fx.GraphModule, found: list, blocks, region: RegionRecord) -> list:
    """``sink_block_residual``: move each body's final residual add into its next call where
    the pattern matches (``shardc.passes.sink_residual``); each body's outcome logged once per
    model and noted in the plan. Returns the calls described again (their operands moved)."""
    outcomes = sink_block_residuals(gm, found)
    for outcome in outcomes:
        region.sink_notes.append(outcome.note())
        if not outcome.reason:
            region.sunk_bodies.add(outcome.identifier)
            region.sink_edits.append(outcome.edits)
        key = f"sink_block_residual:{outcome.block_type}:{outcome.reason}"
        if key not in blocks.reported:
            blocks.reported.add(key)
            log.info("shardc: %s", outcome.note())
    if all(o.reason for o in outcomes):  # nothing sunk: the calls are as they were
        return found
    return describe_body_calls(gm, blocks.block_of_param)


@contextlib.contextmanager
def _no_donated_buffers(region: RegionRecord) -> Iterator[None]:
    """Where the region calls block bodies: AOTAutograd's donated buffers off while it compiles
    (``_torch.no_donated_buffers``), unless its partitioner switches them back on
    (:func:`_switch_donations`). Inductor applies the region backward's donated input positions
    to each body's placeholders, so a body's backward wrote its result into the buffer of the
    gradient it was given, which the region's backward freed at the call and took for a later
    buffer of its size (block i-1's gathered weight; with ``sink_block_residual``, the zeros of
    a recomputed first block) while block i-1's backward was still to read that result: wrong
    gradients (tests/test_body_donations.py, tests/test_sink_residual.py). Off is the default
    here, so a compile that never reaches shardc's ordering of the saved values stays safe.
    Regions without bodies keep them as torch's switch says."""
    if not region.body_calls:
        yield
        return
    before = _torch.donated_buffers_enabled()
    with _torch.no_donated_buffers():
        region.donations_default = before
        try:
            yield
        finally:
            region.donations_default = None


def _switch_donations(region: RegionRecord, bw: fx.GraphModule) -> None:
    """Inside :func:`_no_donated_buffers`: AOTAutograd's donated buffers back as they were for
    the rest of this compile (AOTAutograd reads the switch right after the partition) where
    lowering ordered the saved values so that no body's placeholder is at a donated position
    (``shardc.passes.body_donations``: it stamps the donated inputs), else off. The stamps are
    the same on every rank (the graphs' structure decides), and so is the switch."""
    if region.donations_default is None:  # no bodies, or the FX path (nothing to switch)
        return
    kept = any(n.meta.get(DONATED) for n in bw.graph.find_nodes(op="placeholder"))
    _torch.set_donated_buffers(region.donations_default and kept)
    log.info("shardc: region %d calls block bodies: AOTAutograd's donated buffers %s",
             region.index, "kept (the saved values ordered after every body's inputs)" if kept
             else "off (the plan's notes say why)")


def _prepare_bodies(gm: fx.GraphModule, state: ShardState | None, opts: ShardcOptions,
                    region: RegionRecord) -> None:
    """Record the block bodies Dynamo's graph calls (``shardc.sharding.blocks``), or inline
    them again with ``compile_blocks_once=False``."""
    blocks = state.blocks if state is not None else None
    if blocks is None or not blocks.groups and not blocks.fallbacks:
        return
    region.inline_blocks = [(f.module, f.reason) for f in blocks.fallbacks]
    # Sizes the region reads from a body's outputs (Dynamo hash-conses sizes by expression),
    # computed by the region itself: Inductor cannot view by a size a body returns.
    if recompute_returned_sizes(gm):
        log.debug("shardc: region %d: sizes read from block bodies' outputs computed by the "
                  "region", region.index)
    found = describe_body_calls(gm, blocks.block_of_param)
    if found and opts.compile_blocks_once and share_equal_bodies([n for n, _ in found]):
        # torch 2.11 under dynamic shapes: equal bodies traced apart, now one (body_share).
        found = describe_body_calls(gm, blocks.block_of_param)
    if opts.compile_blocks_once:
        found = _inline_unsupported(gm, found, blocks, region)
    if found and not opts.compile_blocks_once:
        inline_body_calls(gm, [node for node, _ in found])
        region.inline_blocks += [(call.block, "compile_blocks_once=False") for _, call in found]
        return
    if found and opts.sinks_residuals():
        found = _sink_residuals(gm, found, blocks, region)
    region.body_calls = [call for _, call in found]
    called = {call.block for call in region.body_calls}
    traced = {blocks.block_of_param(GatherArgs.of(g).fqn) for g in sharded_gathers(gm)}
    inlined = {module for module, _ in region.inline_blocks}
    for block, _ in sorted(b for b in traced
                           if b is not None and b[0] not in called and b[0] not in inlined):
        # Its wrapped forward ran the block's own forward: hooks or classes changed after
        # shardc.shard (shardc.sharding.blocks.module_layout), or data-dependent input sizes.
        reason = blocks.inline_reason(block)
        region.inline_blocks.append((block, reason))
        blocks.report_inline(block, reason)
    if found:
        bodies = {call.identifier for call in region.body_calls}
        log.info("shardc: region %d calls %d compiled block bod%s %d times", region.index,
                 len(bodies), "y" if len(bodies) == 1 else "ies", len(region.body_calls))
    if found and opts.opaque_body_calls:
        _stand_in(gm, [node for node, _ in found], blocks, region)


def _stand_in(gm: fx.GraphModule, calls: list[fx.Node], blocks, region: RegionRecord) -> None:
    """``opaque_body_calls``: the later calls of each body as stand-ins AOTAutograd does not
    re-trace (``shardc.passes.body_standin``); why calls keep theirs, logged once per model."""
    zeros = [edit.zeros for edit in region.sink_edits if edit.zeros is not None]
    stand_ins = stand_in_later_calls(gm, calls, free_gradients=zeros)
    for reason in dict.fromkeys(stand_ins.skipped):
        key = f"opaque_body_calls:{reason}"
        if key not in blocks.reported:
            blocks.reported.add(key)
            log.info("shardc: region %d: block body calls keep their invoke_subgraph call "
                     "(opaque_body_calls): %s", region.index, reason)
    if stand_ins:
        region.stand_ins = stand_ins
        log.info("shardc: region %d: %d later block body call(s) reach AOTAutograd as "
                 "stand-ins (opaque_body_calls)", region.index, len(stand_ins))


def shardc_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    options: dict | None = None,
    mode: str | None = None,
    **kwargs: Any,
):
    """The backend registered as ``"shardc"``; ``options`` are :class:`ShardcOptions` fields."""
    opts = ShardcOptions.from_kwargs({**(options or {}), **kwargs})
    progress.configure_from_env()
    clock = progress.Stopwatch()
    # Block body calls Dynamo did not trace again (torch < 2.13, shardc.sharding.blocks): first.
    traced_once = rewrite_trace_once_calls(gm)
    if traced_once:
        log.debug("shardc: %d block body calls reuse their first call's trace", traced_once)
    if not has_sharded_params(gm):
        return _compile_unsharded(gm, example_inputs, opts)
    state = _shard_state(gm)
    check_index = _announce(gm, opts)
    dynamo_s = progress.dynamo_seconds()
    return _compile_attempts(gm, example_inputs, opts, mode, state, clock, check_index,
                             dynamo_s)


def _compile_attempts(gm: fx.GraphModule, example_inputs: Sequence[object], opts: ShardcOptions,
                      mode: str | None, state: ShardState | None, clock: progress.Stopwatch,
                      check_index: int | None, dynamo_s: float | None,
                      prepared: RegionRecord | None = None):
    """:func:`_compile_region`, and again where an attempt's plan asks for another compile of
    the same graph: the shards moved to the host, the residual adds not sunk, the body calls
    without stand-ins. Each retry removes its own cause, so the attempts end. Each is decided
    the same on every rank, and gets a new region number: the planner's cross-rank exchanges
    are keyed by it, and the earlier attempt's values are in the store under the old one."""
    registry = state.regions if state is not None else None
    try:
        return _compile_region(gm, example_inputs, opts, mode, state, clock, check_index,
                               dynamo_s, prepared=prepared)
    except auto_offload.ParamOffloadChosen as chosen:
        # The peak budget's last lever: every shard to the host, and the region planned again
        # as a model sharded with OffloadPolicy() (shardc.sharding.auto_offload).
        first = registry.pop()
        moved = auto_offload.move_to_host(state, chosen)
        example_inputs = host_example_inputs(gm, example_inputs, state)
        compiled = _compile_attempts(gm, example_inputs, opts, mode, state, clock,
                                     _announce(gm, opts), dynamo_s, prepared=first)
        plan = registry[-1].plan
        if plan is not None:
            plan.notes.append(auto_offload.note(state.auto_offload, moved))
        return compiled
    except Exception as error:
        first = registry[-1] if registry else None
        sunk = _raised(error, SunkBodiesRecomputed)
        if sunk is not None and first is not None and first.sunk_bodies:
            registry.pop()
            opts = dataclasses.replace(opts, sink_block_residual=False)
            _prepare_unsunk(gm, first, state, opts, sunk)
        else:
            mismatch = _raised(error, StandInMismatch)
            if mismatch is None or first is None or first.stand_ins is None:
                raise
            registry.pop()
            log.warning("shardc: region %d: block body stand-ins do not fit the partitioned "
                        "body (%s); compiling the region again with every call an "
                        "invoke_subgraph call (opaque_body_calls)", first.index, mismatch)
            undo_stand_ins(gm, first.stand_ins)
            first.stand_ins = None
        return _compile_attempts(gm, example_inputs, opts, mode, state, clock,
                                 _announce(gm, opts), dynamo_s, prepared=first)


def _prepare_unsunk(gm: fx.GraphModule, region: RegionRecord, state: ShardState,
                    opts: ShardcOptions, sunk: SunkBodiesRecomputed) -> None:
    """``sink_block_residual="auto"`` where the peak budget recomputes sunk blocks: the
    region's graph as traced again (stand-ins and sinking undone) and ``region``'s bodies
    described again, to compile without sinking (``opts``)."""
    if region.stand_ins is not None:
        undo_stand_ins(gm, region.stand_ins)
    unsink(gm, region.sink_edits)
    # The sunk bodies kept their identifiers, under which the first attempt's traces are
    # recorded in this compile's tracing context: the bodies as traced must be traced anew.
    _torch.forget_subgraph_traces(region.sunk_bodies)
    note = (f"sink_block_residual: not sunk in region {region.index}: the peak budget "
            f"recomputes {', '.join(sunk.blocks)}, whose checkpoints would be both addends of "
            "the sunk residual; compiled again with the residual adds where they were traced")
    log.info("shardc: %s", note)
    region.sink_notes, region.sunk_bodies, region.sink_edits = [note], set(), []
    found = describe_body_calls(gm, state.blocks.block_of_param)
    region.body_calls = [call for _, call in found]
    region.stand_ins = None
    if opts.opaque_body_calls and found:
        _stand_in(gm, [node for node, _ in found], state.blocks, region)


def _raised(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The ``kind`` exception ``error`` is or was raised from (torch may wrap what a
    partitioner raises), or None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _announce(gm: fx.GraphModule, opts: ShardcOptions) -> int | None:
    """The region's number for the cross-rank plan check (None where it is off): numbered as
    compilation starts, so a rank whose collective times out because another rank is
    compiling a region it did not can tell (``plan_check.recompiled_elsewhere``)."""
    if not opts.check_plan_consistency:
        return None
    return announce_region(GatherArgs.of(next(sharded_gathers(gm))).group_name)


# What _prepare_bodies records on a region (from the graph it changes).
_PREPARED_FIELDS = ("inline_blocks", "body_calls", "sink_notes", "sunk_bodies", "sink_edits",
                    "stand_ins")


# Compiling a region builds and drops graph copies (joint, partitioned, flattened, Inductor's
# IR) in reference cycles: with the collector held off they die young after it, and no full
# collection walks the whole process inside it (shardc.memory.gc_pause).
@collector_paused()
def _compile_region(gm: fx.GraphModule, example_inputs: Sequence[object], opts: ShardcOptions,
                    mode: str | None, state: ShardState | None, clock: progress.Stopwatch,
                    check_index: int | None, dynamo_s: float | None,
                    prepared: RegionRecord | None = None):
    """Plan and compile one region whose graph gathers sharded parameters (the backend's
    work after the model is found); a new :class:`RegionRecord` in the model's registry.
    ``prepared``: the record of an earlier attempt at this graph, whose block bodies were
    already prepared (``gm`` changed by that; taken over, not prepared again)."""
    registry = state.regions if state is not None else None
    region = RegionRecord(len(registry) if registry is not None else 0,
                          state.group_roles if state is not None else None,
                          optimizer_on_host=state is not None and (
                              state.offload is not None and not state.offload.params
                              or state.optimizer_planned_on_host),
                          optimizer_host_params=frozenset(state.optimizer_planned_host_params)
                          if state is not None else frozenset(),
                          optimizer_step_chunks=_chunks_always(opts, state),
                          offload_key=state.key if state is not None and state.offload is not None
                          and state.offload.params else "")
    if registry is not None:
        registry.append(region)
    region.check_index = check_index
    if dynamo_s is not None and prepared is None:
        progress.log_stage(region.index, "Dynamo trace", dynamo_s)
    plain_to_local_calls(gm)  # torch 2.11: else AOTAutograd's cache bypasses every region
    _torch.forget_mesh_hashes(example_inputs)  # torch 2.11: else its key differs per process
    if prepared is None:
        _prepare_bodies(gm, state, opts, region)
    else:
        for name in _PREPARED_FIELDS:
            setattr(region, name, getattr(prepared, name))
    partitioner = ShardcPartitioner(opts, region, clock, state)
    patches, note = _mode_patches(gm, example_inputs, opts, mode, state)
    if opts.inductor:
        compile_fx, compile_fx_inner = _torch.inductor_compilers()

        def inner_compile(graph: fx.GraphModule, inputs, **kw: Any):
            if kw.get("is_inference"):
                partitioner.plan_inference(graph)
            name = "Inductor backward" if kw.get("is_backward") else "Inductor forward"
            # The backward compiles at the first backward, after _compile_region returned.
            with collector_paused(), progress.stage(region.index, name):
                return _inductor_with_pool(compile_fx_inner, graph, inputs, region, kw)

        skips = _torch.inductor_cudagraph_skips()
        config_patches = {
            **patches,
            "custom_partitioner_fn": partitioner,
            # shardc plans memory itself; Inductor's peak-memory reordering would move the
            # prefetched all-gathers next to their waits and undo the overlap.
            "reorder_for_peak_memory": False,
        }
        extra = {}
        if opts.keeps_loss_ops_whole():
            # The cross-entropy must reach the joint graph whole for shardc.passes.fused_loss
            # to find it (the pipeline decomposes those it does not fuse).
            extra["decompositions"] = _torch.inductor_decompositions_keeping(LOSS_OPS)
        with _no_donated_buffers(region):
            compiled, store_key = _compile_inductor(
                functools.partial(compile_fx, gm, example_inputs, inner_compile=inner_compile,
                                  config_patches=config_patches, **extra),
                gm, partitioner, _cache_blockers(gm, state, patches))
        if patches.get(cudagraphs.CUDAGRAPHS) and _torch.inductor_cudagraph_skips() > skips:
            note = ("CUDA graphs requested; Inductor declined to record at least one graph of "
                    "this region (TORCH_LOGS=perf_hints says why)")
            cudagraphs.warn(region.index, note)
    else:
        store_key = None
        fx_compiler = functools.partial(_fx_compiler, region=region)

        def inference_compiler(graph: fx.GraphModule, inputs):
            return fx_compiler(partitioner.plan_inference(graph), inputs)

        compiled = _torch.aot_autograd(
            fw_compiler=fx_compiler, bw_compiler=fx_compiler, partition_fn=partitioner,
            inference_compiler=inference_compiler,
        )(gm, example_inputs)
    if note and region.plan is not None and note not in region.plan.notes:
        region.plan.notes.append(note)
    if opts.inductor and store_key is not None:
        _store_plan(store_key, partitioner, region)
    _apply_optimizer_offload(region, state)
    _apply_optimizer_chunks(region, state)
    progress.log_stage(region.index, "compiled (backend total)", clock.total())
    return _checked(compiled, region, opts)


shardc_backend._shardc_trace_once = True  # rewrites shardc.ops.body_call (sharding/blocks.py)


def _apply_optimizer_offload(region: RegionRecord, state: ShardState | None) -> None:
    """Where the region's peak budget put the optimizer's state on the host
    (``shardc.planning.optimizer_offload``), have those parameters step there
    (``shardc.runtime.offload_optimizer.adopt``): the ones it chose, or every parameter of the
    model where it chose them all; the others keep stepping on the device, in the same
    parameter groups. The same on every rank (the decision is)."""
    budget = region.plan.budget if region.plan is not None else None
    if state is None or budget is None or not budget.optimizer_on_host:
        return
    root = _sharded_root(region, state, "'s peak budget put the optimizer's state on the host")
    chosen = budget.optimizer.host_params
    if chosen is None:
        state.optimizer_planned_on_host = True
        params = list(root.named_parameters())
    else:  # the later regions plan with these on the host
        state.optimizer_planned_host_params.update(chosen)
        # A packed block's name stands for its parameters (shardc.sharding.packed_blocks).
        wanted = set(packed_blocks.expand(chosen, state.packed))
        params = [(fqn, p) for fqn, p in root.named_parameters() if fqn in wanted]
    pin = state.mesh.device_type == "cuda" and torch.cuda.is_available()
    added = offload_optimizer.adopt(params, pin)
    log.info("shardc: region %d: the optimizer steps %d more parameter(s) on the host (peak "
             "budget)", region.index, added)


def _sharded_root(region: RegionRecord, state: ShardState, decided: str) -> torch.nn.Module:
    """The sharded model whose region ``decided`` something about its optimizer step; raises
    where it is gone (nothing left to apply the decision to)."""
    root = state.root() if state.root is not None else None
    if root is None:
        raise RuntimeError(f"shardc: region {region.index}{decided}, but the sharded model is "
                           "gone")
    return root


def _chunks_always(opts: ShardcOptions, state: ShardState | None) -> bool:
    """Whether a region starts with the optimizer step in chunks: ``optimizer_step_chunks=
    'always'``, where no optimizer state of the model is on the host (it never combines with
    the optimizer's offload)."""
    return (opts.optimizer_step_chunks == "always" and state is not None
            and state.offload is None and not state.optimizer_planned_on_host
            and not state.optimizer_planned_host_params)


def _apply_optimizer_chunks(region: RegionRecord, state: ShardState | None) -> None:
    """Where the region's plan steps the optimizer in chunks (the peak budget's choice, or
    ``optimizer_step_chunks='always'``), have ``optimizer.step()`` step the region's
    parameters one bucket at a time (``shardc.runtime.chunked_step.adopt``; chunk keys: the
    model, the region, the bucket). The same on every rank (the decision and buckets are)."""
    if state is None or region.plan is None or not region.optimizer_step_chunks:
        return
    root = _sharded_root(region, state, "'s plan steps the optimizer in chunks")
    named = dict(root.named_parameters())
    parts = optimizer_chunks.chunks(region.plan.buckets, ())
    chunks = [((state.key, region.index, i),
               [named[f] for f in packed_blocks.expand(part, state.packed) if f in named])
              for i, part in enumerate(parts)]
    added = chunked_step.adopt(chunks)
    if region.plan.budget is None:
        region.plan.notes.append(
            f"optimizer step in {len(parts)} chunks, one per bucket "
            "(optimizer_step_chunks='always')")
    log.info("shardc: region %d: the optimizer steps %d parameter(s) in %d chunks", region.index,
             added, len(parts))


def _cache_blockers(gm: fx.GraphModule, state: ShardState | None,
                    patches: dict[str, Any]) -> list[str]:
    """Why the region keeps AOTAutograd's cache off (``shardc.compile.warm``); empty: on."""
    if state is None:
        return ["the sharded model's state is gone"]
    fp8 = state.fp8 is not None or any(i.quantized for i in state.params.values())
    return warm.cache_blockers(list(sharded_gathers(gm)), gm, fp8=fp8,
                               offload=state.offload is not None
                               or state.auto_offload is not None,
                               cudagraphs=bool(patches.get(cudagraphs.CUDAGRAPHS)),
                               needs_partition=pipeline.partitioned_graphs_wanted())


def _compile_inductor(compile_region, gm: fx.GraphModule, partitioner: ShardcPartitioner,
                      blockers: list[str]):
    """``compile_region()`` (``compile_fx`` on the region) with AOTAutograd's cache where
    ``blockers`` allow it and torch has it on; returns the compiled region and, after a miss
    whose plan may be stored, the entry's key (``shardc.compile.warm``). A hit whose plan cannot
    be restored is dropped and the region compiled again with the cache off."""
    region = partitioner.region
    wanted = _torch.autograd_cache_enabled() and warm.switched_on()
    if blockers or not wanted:
        if blockers and wanted:
            log.debug("shardc: region %d: AOTAutograd's cache stays off: %s", region.index,
                      "; ".join(blockers))
        with _torch.no_autograd_cache():
            return compile_region(), None
    hits = _torch.autograd_cache_hits()
    with _torch.autograd_cache_lookups() as seen:
        compiled = compile_region()
    outcome, key = warm.lookup_outcome(seen, _torch.autograd_cache_hits() - hits)
    if outcome != "hit":
        return compiled, key if outcome == "miss" else None
    why = "the partitioner ran on a hit"
    if region.plan is None:
        gathered = {GatherArgs.of(g).fqn for g in sharded_gathers(gm)}
        plan, why = warm.load_plan(key, partitioner.uuid(), gathered)
        if plan is not None:
            restore_region(region, plan)
            pipeline.dump_if_asked(plan, partitioner.options)
            log.info("shardc: region %d: AOTAutograd cache hit; plan %s restored (%s)",
                     region.index, plan.hash(), warm.plan_path(key))
            return compiled, None
    log.warning("shardc: region %d: AOTAutograd's cache hit, but shardc's plan cannot be "
                "restored (%s); compiling the region again without the cache", region.index, why)
    region.plan = region.forward = region.backward = region.pool = None
    with _torch.no_autograd_cache():
        return compile_region(), None


def restore_region(region: RegionRecord, plan: Plan) -> None:
    """Put a plan restored on an AOTAutograd cache hit in the region's record, with what the
    runtime reads beside it that planning would have set: the bodies' partitions and whether
    the optimizer steps in chunks (the peak budget's choice; without it a warm start would step
    in one call and hold every shard's temporaries the budget planned away)."""
    region.plan = plan
    region.body_partitions = {b.name: b.partitions for b in plan.bodies}
    chunks = plan.budget.optimizer_chunks if plan.budget is not None else None
    if chunks is not None and chunks.chunked:
        region.optimizer_step_chunks = True


def _store_plan(key: str, partitioner: ShardcPartitioner, region: RegionRecord) -> None:
    """After a miss: store the plan beside AOTAutograd's entry ``key`` if a hit could run as this
    miss does (``warm.restorable``)."""
    why = warm.restorable(region.forward, region.backward, region.plan, region.pool)
    if why is not None:
        log.info("shardc: region %d: no plan stored for AOTAutograd's cache (%s); a hit on its "
                 "entry compiles again", region.index, why)
        return
    path = warm.save_plan(key, partitioner.uuid(), region.plan)
    if path is not None:
        log.debug("shardc: region %d: plan %s stored at %s", region.index, region.plan.hash(),
                  path)


def _mode_patches(gm: fx.GraphModule, example_inputs, opts: ShardcOptions, mode: str | None,
                  state: ShardState | None) -> tuple[dict[str, Any], str | None]:
    """Inductor config patches for ``torch.compile``'s ``mode``, with CUDA graphs turned off
    (loudly: a warning and the returned plan note) where the region cannot be recorded
    (:mod:`shardc.compile.cudagraphs`)."""
    if not opts.inductor:
        if mode not in (None, "default"):
            note = (f"mode={mode!r} ignored: it configures Inductor and this backend has "
                    "inductor=False")
            log.warning("shardc: %s", note)
            return {}, note
        return {}, None
    patches = cudagraphs.inductor_patches(mode)
    if not cudagraphs.wants_cudagraphs(patches):
        return patches, None
    fp8 = state is not None and (state.fp8 is not None
                                 or any(i.quantized for i in state.params.values()))
    reasons = cudagraphs.blockers((GatherArgs.of(n) for n in sharded_gathers(gm)),
                                  example_inputs, fp8,
                                  offload=state is not None and state.offload is not None
                                  and state.offload.params)
    if not reasons:
        return {**patches, cudagraphs.CUDAGRAPHS: True}, None
    note = cudagraphs.fallback_note(reasons)
    cudagraphs.warn(len(state.regions) - 1 if state is not None else 0, note)
    return {**patches, cudagraphs.CUDAGRAPHS: False}, note


def backend(**options: Any):
    """A ``torch.compile`` backend with these :class:`ShardcOptions` (validated now)."""
    opts = ShardcOptions.from_kwargs(options)

    def configured_shardc(gm: fx.GraphModule, example_inputs: Sequence[object], **kw: Any):
        return shardc_backend(gm, example_inputs, {**opts.as_dict(), **kw.pop("options", {})}, **kw)

    # Rewrites shardc.ops.body_call (sharding/blocks.py); compile_blocks_once=False traces every
    # block as before.
    configured_shardc._shardc_trace_once = opts.compile_blocks_once
    return configured_shardc
