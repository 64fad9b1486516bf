"""Reshard after forward: gathered parameters are recomputed (re-gathered) in backward, never saved.

``tag_resharded_gathers`` runs on the joint graph before partitioning and marks each gather of a
``reshard_after_forward`` parameter, and the views and casts taken of it, as must-recompute, so the
partitioner saves the (small) shard instead and the backward graph gathers again.
``check_no_gathered_saved`` runs on the partitioned graphs and fails loudly if a gathered parameter
still crosses from forward to backward.
Both follow a gather through copies too (:func:`gathered_forms`): a packed block's unpack copies
each weight out of the gathered buffer above world 1, and where the body is inlined
(``compile_blocks_once=False``) those copies are in the region's own graph.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.ops.offload_copy import is_to_device
from shardc.passes.body import body_calls, weight_derived_outputs
from shardc.passes.fx_utils import (
    gather_derived,
    is_call,
    is_view_or_cast,
    op_overload,
    recompute_tag,
    view_chain,
)

__all__ = ["GatheredParamSavedError", "check_no_gathered_saved", "gather_derived",
           "gathered_forms", "keep_gathered", "reshards_after_forward", "saved_for_backward",
           "tag_resharded_gathers"]

# Single-input copies: a packed block's unpack (shardc.sharding.packed_blocks.PackedLayout.unpack)
# reshapes a strided slice of the gathered buffer, which AOTAutograd records as a clone and an
# _unsafe_view.
_COPIES = frozenset({torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default})


def reshards_after_forward(gather: fx.Node) -> bool:
    return bool(GatherArgs.of(gather).reshard_after_forward)


def keep_gathered(graph: fx.Graph, fqns: set[str]) -> int:
    """Make the gathers of the parameters ``fqns`` keep their gathered values from the forward
    to the backward (``reshard_after_forward=False`` in their arguments), before
    :func:`tag_resharded_gathers` runs: the budget planner's choice (``shardc.planning.budget``).
    Returns how many gathers changed."""
    count = 0
    for node in graph.nodes:
        if is_call(node, GATHER_OP) and reshards_after_forward(node):
            args = GatherArgs.of(node)
            if args.fqn in fqns:
                node.args, node.kwargs = replace(args, reshard_after_forward=False).args(), {}
                count += 1
    return count


def gathered_forms(gather: fx.Node) -> list[fx.Node]:
    """``gather`` and every node reachable from it through views, casts and copies of one
    input only: the gathered value in another form, which the backward must not take saved
    from the forward (:func:`gather_derived` stops at copies: it bounds the gathered buffer's
    own lifetime, which a copy out of it does not extend)."""
    seen, stack = {gather: None}, [gather]  # a dict: insertion-ordered, O(1) membership
    while stack:
        for user in stack.pop().users:
            if user in seen or user.op != "call_function":
                continue
            if is_view_or_cast(user) or (op_overload(user) in _COPIES
                                         and len(user.all_input_nodes) == 1):
                seen[user] = None
                stack.append(user)
    return list(seen)


def tag_resharded_gathers(graph: fx.Graph) -> int:
    """Mark resharded gathers (and their views) must-recompute; returns how many gathers.

    The views between a parameter shard (a graph input) and its gather are marked too: the
    partitioner could save either the shard or such a view for the backward's re-gather, the same
    bytes, a tie its min cut breaks differently from block to block (saving shards in the lower
    blocks and views in the upper ones). Recomputing the view, which is free, makes every block
    save its shard, so identical blocks partition into identical graphs (``shardc.tools.template``
    relies on it)."""
    count = 0
    for node in graph.nodes:
        if is_call(node, GATHER_OP) and reshards_after_forward(node):
            for derived in gathered_forms(node) + sent_chain(GatherArgs.of(node).shard):
                recompute_tag(derived, CheckpointPolicy.MUST_RECOMPUTE)
            count += 1
    return count


def sent_chain(shard: fx.Node) -> list[fx.Node]:
    """The nodes between a parameter shard (a graph input) and what its gather sends: views,
    and under CPU offload the host->device copy (recomputed too: a saved device copy would keep
    every shard on the device from the forward to the backward)."""
    if is_to_device(shard):
        return [shard] + (view_chain(shard.all_input_nodes[0]) or [])
    return view_chain(shard) or []


class GatheredParamSavedError(RuntimeError):
    """A gathered (full) parameter would be kept alive from forward to backward."""


def saved_for_backward(fw: fx.GraphModule, bw: fx.GraphModule) -> list[fx.Node]:
    """Forward-graph nodes whose values the backward graph takes as saved inputs."""
    by_name = {n.name: n for n in fw.graph.nodes}
    saved = []
    for ph in bw.graph.find_nodes(op="placeholder"):
        if not ph.name.startswith("tangents") and ph.name in by_name:
            saved.append(by_name[ph.name])
    return saved


def check_no_gathered_saved(fw: fx.GraphModule, bw: fx.GraphModule) -> None:
    """Raise :class:`GatheredParamSavedError`, naming the parameter, if a resharded gather is
    saved for backward."""
    offending = {}
    for gather in fw.graph.nodes:
        if is_call(gather, GATHER_OP) and reshards_after_forward(gather):
            for derived in gathered_forms(gather):
                offending[derived] = gather
            shard = GatherArgs.of(gather).shard
            if is_to_device(shard):  # offload: the device copy of the shard
                offending[shard] = gather
    # A block body (shardc.passes.body) returns values it saves for its backward: those computed
    # from gathered weights alone would keep the weights alive in another form.
    for call in body_calls(fw):
        derived = weight_derived_outputs(fw, call, lambda a: a in offending)
        for user in call.users:
            if is_call(user, operator.getitem) and user.args[1] in derived:
                offending[user] = offending[derived[user.args[1]]]
    for node in saved_for_backward(fw, bw):
        if node in offending:
            fqn = GatherArgs.of(offending[node]).fqn
            raise GatheredParamSavedError(
                f"shardc: the gathered parameter {fqn!r} (graph value {node.name!r}) would be "
                "saved for backward although reshard_after_forward=True. This is a shardc bug; "
                "report it with the graph dump, or shard with reshard_after_forward=False."
            )
