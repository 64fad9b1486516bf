"""The ``shardc`` torch.compile backend.

Dynamo hands over a forward graph in which every sharded parameter is read through
``shardc::gather_param``. AOTAutograd traces forward and backward together; shardc's partitioner
(:class:`ShardcPartitioner`) then runs the joint-graph passes, partitions (gathered parameters are
recomputed, never saved, when resharding after forward), checks the result, and plans the
communication of both graphs. Inductor (or, with ``inductor=False``, plain FX) compiles the
planned graphs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import fx

from shardc.options import ShardcOptions
from shardc.passes.dedupe import dedupe_gathers, merge_reduce_scatters
from shardc.passes.fp8 import hoist_fp8_quantize, prepare_fp8
from shardc.passes.fx_utils import allocate_real, copy_graph_module, is_call
from shardc.passes.lower import POOL_PLACEHOLDER, add_pool_placeholder, apply_plan
from shardc.passes.memory import assign_pool, param_placeholders, predict_peak
from shardc.passes.reshard import check_no_gathered_saved, tag_resharded_gathers
from shardc.passes.saved_order import order_saved_values
from shardc.passes.schedule import plan_region
from shardc.runtime.collectives import resolve_group
from shardc.runtime.comm_errors import boxed_with_collective_errors, guard_inductor_graph
from shardc.runtime.ops import GATHER_OP
from shardc.runtime.plan_check import announce_region, check_plan_consistency

log = logging.getLogger("shardc")

_SOURCE_ROOT = Path(__file__).resolve().parent


# Set by capture_partitioned(): where regions compiled in its scope leave their partitioned graphs.
_PARTITIONED_SINK: ContextVar[list | None] = ContextVar("shardc_partitioned_sink", default=None)


@contextlib.contextmanager
def capture_partitioned() -> Iterator[list[tuple[fx.GraphModule, fx.GraphModule]]]:
    """Collect a copy of the partitioned, not yet planned ``(forward, backward)`` graphs of every
    training region compiled inside this context (``shardc.template`` repeats them to plan a
    deeper model). The regions themselves are planned and compiled as usual."""
    sink: list = []
    token = _PARTITIONED_SINK.set(sink)
    try:
        yield sink
    finally:
        _PARTITIONED_SINK.reset(token)


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
def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(_SOURCE_ROOT.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _partitioner_base():
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


class ShardcPartitioner(_partitioner_base()):
    """Joint-graph passes, min-cut partition, checks, then communication planning."""

    def __init__(self, options: ShardcOptions, region: RegionRecord) -> None:
        self.options = options
        self.region = region
        # Compile caches key DTensor inputs by their global shape, but the compiled graphs hold
        # this rank's local shard shapes (uneven across ranks): key the cache by rank too.
        dist = torch.distributed
        self.rank_key = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
        self.fp8 = None  # what the FP8 passes did (shardc.passes.fp8.Fp8Summary)

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        self.fp8 = prepare_fp8(gm.graph)
        dedupe_gathers(gm.graph)
        merge_reduce_scatters(gm.graph)
        tag_resharded_gathers(gm.graph)
        gm.recompile()
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        # The parameters' DeviceMesh is saved for the backward (it builds the DTensor gradients);
        # checkpointed random ops (SDPA, dropout) save RNG states behind it, out of the order
        # AOTAutograd reads saved values in: put them back (shardc/passes/saved_order.py).
        order_saved_values(fw, bw, kwargs["num_fwd_outputs"])
        check_no_gathered_saved(fw, bw)
        sink = _PARTITIONED_SINK.get()
        if sink is not None:
            sink.append((copy_graph_module(fw), copy_graph_module(bw)))
        self.plan_and_lower(fw, bw)
        return fw, bw

    def plan_inference(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Plan a forward-only graph (``torch.no_grad()`` / eval): gathers only, no reductions."""
        if has_sharded_params(gm):
            self.fp8 = prepare_fp8(gm.graph)
            dedupe_gathers(gm.graph)
            gm.recompile()
            self.plan_and_lower(gm, None)
        return gm

    def plan_and_lower(self, fw: fx.GraphModule, bw: fx.GraphModule | None) -> None:
        hoist_fp8_quantize(fw)
        hoist_fp8_quantize(bw)
        plan = self._plan_within_budget(fw, bw)
        if self.fp8 is not None:
            plan.notes.append(self.fp8.note())
        fw_params = param_placeholders(fw)
        bw_params = param_placeholders(bw) if bw is not None else set()
        rank = _rank_of(plan)
        pool = self._pool(fw, plan) if bw is not None else None
        self.region.pool = pool
        poison = self.options.debug_pool
        for gm, name in ((fw, "forward"), (bw, "backward")):
            if gm is None:
                continue
            # Inductor sees the pool as a graph input it writes into (a constant would be
            # copied or folded); the compiled graph's caller appends it (_inductor_with_pool).
            where = add_pool_placeholder(gm, pool) if pool is not None and self.options.inductor \
                else pool
            apply_plan(gm, plan, name, rank, pool=where, poison=poison)
        predict_peak(fw, bw, plan, fw_params, bw_params,
                     optimizer_state_factor=self.options.optimizer_state_factor,
                     optimizer_temp_factor=self.options.optimizer_temp_factor,
                     persistent_bytes=pool.numel() if pool is not None else 0,
                     fusion=self.options.inductor)
        self.region.forward, self.region.backward, self.region.plan = fw, bw, plan
        if self.options.dump_dir:
            from shardc.render import dump_plan

            try:
                dump_plan(plan, self.options.dump_dir, rank=rank)
            except OSError as exc:  # a dump must never break training
                log.warning("shardc: could not write the plan dump: %s", exc)

    def _pool(self, fw: fx.GraphModule, plan) -> torch.Tensor | None:
        """The region's communication pool, allocated once and shared by its forward and
        backward (training graphs; forward-only graphs let the compiler place the buffers)."""
        if not self.options.comm_pool:
            plan.notes.append("communication buffers: allocated per collective (no static pool)")
            return None
        # The device of what the gathers send (parameter shards, or an FP8 weight's quantized
        # shard, whose placeholder param_placeholders does not find through the quantization).
        sent = [n.args[0].meta["val"] for n in fw.graph.nodes if is_call(n, GATHER_OP)]
        device = sent[0].device if sent else torch.device("cpu")
        plan.notes.append("communication buffers: views of one static pool")
        return allocate_real(int(plan.predicted["pool_bytes"]), torch.uint8, device)

    def _plan_within_budget(self, fw: fx.GraphModule, bw: fx.GraphModule):
        """Plan, place the buffers in the pool, and while the pool exceeds the memory budget,
        plan again with shallower prefetch (the budget is checked on the real pool size)."""
        options = self.options
        while True:
            plan = plan_region(fw, bw, options, region=self.region.index,
                               groups=self.region.groups)
            assign_pool(plan)
            budget = options.memory_budget_bytes
            if not budget or plan.predicted["pool_bytes"] <= budget or not options.prefetch:
                return plan
            if options.prefetch_depth <= 1:
                options = replace(options, prefetch=False)
            else:
                options = replace(options, prefetch_depth=options.prefetch_depth - 1)
            plan.notes.append(f"pool {plan.predicted['pool_bytes']:.0f} B over budget {budget} B")

    def uuid(self) -> str:
        options = sorted(self.options.as_dict().items())
        return f"shardc-{_source_hash()}-{options}-rank{self.rank_key}"


class RegionRecord:
    """What shardc keeps about one compiled region: its graphs and its plan."""

    def __init__(self, index: int, groups: dict[str, tuple[str, int]] | None = None) -> None:
        self.index = index
        # Process group name -> (role on the mesh, ranks), for the plan (MeshLayout.group_roles).
        self.groups = groups
        self.forward: fx.GraphModule | None = None
        self.backward: fx.GraphModule | None = None
        self.plan = None
        self.checked = False
        self.pool: torch.Tensor | None = None
        self.check_index: int | None = None  # the region's number for the cross-rank plan check


def _rank_of(plan) -> int:
    if not plan.group_name or plan.world_size == 1:
        return 0
    return torch.distributed.get_rank(resolve_group(plan.group_name))


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


def _shard_state(gm: fx.GraphModule):
    """The :class:`ShardState` of the sharded model whose parameters ``gm`` gathers, found through
    the model key every gather carries as a constant (``sync_key``), or None (a model that is
    gone). Nothing is looked up on parameter objects: ``nn.Module._apply`` swaps them."""
    from shardc.runtime.sharding import state_for_key

    for gather in sharded_gathers(gm):
        key = gather.args[9] if len(gather.args) > 9 else gather.kwargs.get("sync_key", "")
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
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    return gm.forward


def shardc_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    options: dict | None = None,
    mode: str | None = None,
    **kwargs: Any,
):
    """The backend registered as ``"shardc"``; ``options`` are :class:`ShardcOptions` fields."""
    opts = ShardcOptions.from_kwargs({**(options or {}), **kwargs})
    if not has_sharded_params(gm):
        return _compile_unsharded(gm, example_inputs, opts)
    state = _shard_state(gm)
    registry = state.regions if state is not None else None
    region = RegionRecord(len(registry) if registry is not None else 0,
                          state.group_roles if state is not None else None)
    if registry is not None:
        registry.append(region)
    if opts.check_plan_consistency:
        # Numbered as compilation starts, so a rank whose collective times out because another
        # rank is compiling a region it did not can tell (plan_check.recompiled_elsewhere).
        gather = next(sharded_gathers(gm))
        region.check_index = announce_region(gather.args[4])
    partitioner = ShardcPartitioner(opts, region)
    if opts.inductor:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph: fx.GraphModule, inputs, **kw: Any):
            if kw.get("is_inference"):
                partitioner.plan_inference(graph)
            return _inductor_with_pool(compile_fx_inner, graph, inputs, region, kw)

        # AOTAutograd's cache would skip shardc's partitioner on a hit, and with it the plan
        # (explain, dumps, the cross-rank check); Inductor's own graph cache still applies.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = compile_fx(
                gm, example_inputs, inner_compile=inner_compile,
                config_patches={
                    "custom_partitioner_fn": partitioner,
                    # shardc plans memory itself; Inductor's peak-memory reordering would move the
                    # prefetched all-gathers next to their waits and undo the overlap.
                    "reorder_for_peak_memory": False,
                },
            )
    else:
        from torch._dynamo.backends.common import aot_autograd

        fx_compiler = functools.partial(_fx_compiler, region=region)

        def inference_compiler(graph: fx.GraphModule, inputs):
            return fx_compiler(partitioner.plan_inference(graph), inputs)

        compiled = aot_autograd(
            fw_compiler=fx_compiler, bw_compiler=fx_compiler, partition_fn=partitioner,
            inference_compiler=inference_compiler,
        )(gm, example_inputs)
    return _checked(compiled, region, opts)


def backend(**options: Any):
    """A ``torch.compile`` backend with these :class:`ShardcOptions` (validated now)."""
    opts = ShardcOptions.from_kwargs(options)

    def configured_shardc(gm: fx.GraphModule, example_inputs: Sequence[object], **kw: Any):
        return shardc_backend(gm, example_inputs, {**opts.as_dict(), **kw.pop("options", {})}, **kw)

    return configured_shardc
