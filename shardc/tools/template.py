"""Plan a deep model from a trace of a few of its blocks (the per-block template).

Tracing a model for planning (Dynamo, AOTAutograd's joint trace, the min-cut partition) costs
time in proportion to its depth: about a second per Llama-70B block on a 2-core machine. When
every block of ``model.<container>`` (an ``nn.ModuleList``) is the same module with the same
parameter shapes and dtypes, the partitioned graphs repeat one segment per interior block;
:func:`plan_from_template` traces only the first ``blocks`` blocks, checks that their graphs do
repeat (``shardc.passes.repeat``), builds the full-depth partitioned graphs by repeating the
segment, and plans them with the same passes as a full trace. Anything that does not repeat
raises :class:`TemplateRefused` naming why; the caller then traces the whole model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from shardc.compile.backend import backend
from shardc.compile.options import ShardcOptions
from shardc.compile.pipeline import RegionRecord, capture_partitioned, plan_and_lower
from shardc.passes.repeat import NotPeriodic, find_periods, repeat_periods
from shardc.planning.plan import Plan
from shardc.sharding.scope import shard_state
from shardc.sharding.shard import shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Head block, three periods (two comparisons, one of them of the step between periods), tail.
TEMPLATE_BLOCKS = 5

_PLAIN = (bool, int, float, str, type(None), tuple, torch.dtype)


class TemplateRefused(ValueError):
    """The model cannot be planned from a template; the message says why."""


def comparable_plan(plan: Plan) -> dict:
    """``plan``'s JSON data without graph node names and notes, to compare a template plan with
    a full trace's: node names come from the tracer's counters, which differ between the two
    (also in the memory breakdown's values live at the peak).
    What each schedule position holds (op, FLOPs, bytes, predicted times) stays, which fixes each
    collective's ``overlaps`` (the ops between its issue and wait positions): only their number
    is kept."""
    data = plan.to_dict()
    for ops in data["graphs"].values():
        for op in ops:
            del op["name"]
    for c in data["collectives"]:
        c["overlaps"] = len(c["overlaps"])
        if c.get("origin", "shardc") != "shardc":
            # A collective found in the graph (tensor parallelism's) is described by its nodes,
            # tensors and the module that issued it; a repeated block's copy keeps the template
            # block's names (its reason names that block's module): compare shapes and kinds.
            c["nodes"] = len(c.get("nodes", ()))
            c["tensors"] = [t.split(": ", 1)[-1] for t in c.get("tensors", ())]
            c.pop("reason", None)
    # The memory breakdown's positions are graph node indices, placeholders included, and the
    # expanded template has no placeholders for the repeated blocks' parameters (their shards
    # are counted all the same): each graph's timeline is compared by its categories' largest
    # and final bytes, the peak exactly, and the values live there (named by node, equal sizes
    # tied in any order) by category and size.
    memory = data.get("memory_by_category") or {}
    for graph in (memory.get("graphs") or {}).values():
        graph.pop("positions", None)
        graph["bytes"] = {cat: [max(v, default=0), v[-1] if v else 0]
                          for cat, v in graph["bytes"].items()}
    peak = memory.get("peak") or {}
    if "largest" in peak:
        peak["largest"] = sorted([cat, nbytes] for _, cat, nbytes in peak["largest"])
    data.pop("notes")
    # Which blocks compiled inline and why: said per traced block (a template traces fewer).
    data.pop("inline_blocks", None)
    data.pop("hash")  # of the collectives' signatures: kept in them
    return data


def plan_digest(plan: Plan) -> str:
    """A short hash of :func:`comparable_plan`: equal for a template plan and its full trace."""
    blob = json.dumps(comparable_plan(plan), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def block_signature(block: nn.Module) -> tuple:
    """What must be equal for two blocks to trace to the same graph: every submodule's name,
    class, plain public attributes (numbers, strings, dtypes: e.g. ``eps``, a head count, a layer
    id) and hook counts, and every parameter's and buffer's name, shape, dtype and whether it
    requires a gradient."""
    modules = []
    for name, m in block.named_modules(remove_duplicate=False):
        attrs = sorted(((k, v) for k, v in vars(m).items()
                        if not k.startswith("_") and isinstance(v, _PLAIN)), key=lambda kv: kv[0])
        modules.append((name, type(m), tuple(attrs), len(m._forward_pre_hooks),
                        len(m._forward_hooks)))
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in block.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype)
                    for n, b in block.named_buffers(remove_duplicate=False))
    return tuple(modules), params, buffers


def check_blocks_identical(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Raise :class:`TemplateRefused` unless all ``blocks`` have one :func:`block_signature` and
    own their parameters (none shared between blocks or with the rest of ``model``)."""
    first = block_signature(blocks[0])
    for i, block in enumerate(blocks[1:], start=1):
        if block_signature(block) != first:
            raise TemplateRefused(f"block {i} differs from block 0 (modules, attributes, "
                                  "parameter or buffer shapes and dtypes)")
    inside = [id(p) for block in blocks for p in block.parameters()]
    if len(set(inside)) != len(inside):
        raise TemplateRefused("blocks share parameters")
    outside = {id(p) for p in model.parameters()} - set(inside)
    if len(outside) + len(inside) != sum(1 for _ in model.parameters()):
        raise TemplateRefused("a block parameter is also used outside the blocks")


def _blocks(model: nn.Module, container: str, keep: int) -> nn.ModuleList:
    """``model.<container>``, checked to be an ``nn.ModuleList`` of more than ``keep`` blocks."""
    layers = model.get_submodule(container)
    if not isinstance(layers, nn.ModuleList):
        raise TemplateRefused(f"{container} is not an nn.ModuleList")
    if len(layers) <= keep:
        raise TemplateRefused(f"{len(layers)} blocks: no more than the {keep} a template traces")
    return layers


def _keep_first(model: nn.Module, container: str, layers: nn.ModuleList, keep: int) -> None:
    """Make ``model.<container>`` hold only the first ``keep`` of ``layers``."""
    parent, _, name = container.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name,
            nn.ModuleList(list(layers)[:keep]))


def plan_from_template(
    model: nn.Module,
    mesh: DeviceMesh,
    run: Callable[[nn.Module], Any] | None,
    options: dict,
    *,
    container: str = "layers",
    blocks: int = TEMPLATE_BLOCKS,
    trace: Callable[[nn.Module], Any] | None = None,
) -> Plan:
    """The plan of one training step of ``model`` (unsharded, e.g. on the meta device, with all
    its blocks), made from a trace of its first ``blocks`` blocks.

    ``model`` is changed in place: ``model.<container>`` keeps only the traced blocks and the
    model is sharded over ``mesh``; rebuild it to trace it whole after a refusal. ``run(compiled)``
    calls the compiled model once (a forward is enough: the backward is partitioned with it).
    ``options`` are the ``shardc`` backend options. ``trace(model)``, if given, replaces sharding,
    compiling and ``run``: it must shard the trimmed model over ``mesh`` and compile one training
    step of it with these options (``shardc.tools.planner.trace_step``). Raises
    :class:`TemplateRefused` if the blocks differ, the model compiles to more than one region, or
    the traced graphs do not repeat.
    """
    layers = _blocks(model, container, blocks)
    check_blocks_identical(model, list(layers))
    n_blocks = len(layers)
    _keep_first(model, container, layers, blocks)
    with capture_partitioned() as graphs:
        if trace is not None:
            trace(model)
        else:
            shard(model, mesh)
            if run is None:
                raise TypeError("plan_from_template: pass run or trace")
            run(torch.compile(model, backend=backend(**options)))
    if len(graphs) != 1:
        raise TemplateRefused(f"the traced blocks compiled to {len(graphs)} training regions, "
                              "not one (graph breaks, or no backward)")
    forward, backward = graphs[0]
    try:
        forward = repeat_periods(find_periods(forward, container, blocks), n_blocks)
        backward = repeat_periods(find_periods(backward, container, blocks), n_blocks)
    except NotPeriodic as exc:
        raise TemplateRefused(f"the traced graphs do not repeat: {exc}") from None
    # The traced region's process groups (tp, replicate) name the roles of the collectives
    # found in its graphs and of HSDP's all-reduces.
    traced = shard_state(model).regions
    groups = traced[-1].groups if traced else None
    # The traced region's fused-loss decision: its captured graphs are the fused ones.
    fused = traced[-1].fused_loss if traced else None
    plan = plan_and_lower(forward, backward, ShardcOptions.from_kwargs(options),
                          RegionRecord(0, groups=groups, fused_loss=fused))
    plan.notes.append(
        f"planned from a template: blocks 0-{blocks - 1} of {container} traced, the graphs of "
        f"blocks {blocks - 1}-{n_blocks - 2} repeated from block {blocks - 2}'s")
    return plan
