"""Recompute single saved activations of a block body: its cheap ones (the peak budget's
recompute per saved value, chosen by ``shardc.compile.budget_search``).

A compile-once body's forward (``shardc.sharding.blocks``) returns its block's output and the
values its backward body reads. Some of those are made by elementwise work from other values
the backward reads anyway: in a Llama block the normalized hidden states (the hidden state
times its saved reciprocal norm times the norm's weight) and the SwiGLU product (``silu(gate) *
up``, from the two saved projections). Saving them costs as many bytes as saving a projection;
computing them again costs one memory-bound kernel. Recomputing the whole block instead runs its
matrix products and attention again.

:func:`cheap_outputs` finds them in a body's forward graph: the outputs whose *cone* (the nodes
that compute them, down to the body's inputs and to its other outputs that stay saved) is only
elementwise ops and views. Any subset of them can be recomputed: a cheap output that another
one reads is part of that one's cone, never a value it expects saved.

:func:`recompute_values` rewrites a region's joint graph for one body call: it copies the cones
of the chosen outputs into the region's graph, reading the call's operands (the block's input,
its gathered weights) and the call's other outputs, tags the copies ``MUST_RECOMPUTE`` with the
block's activation-checkpoint id (``shardc.passes.recompute``'s), and gives the backward body
call the copies in place of the saved outputs. torch's partitioner then computes them in the
backward, and no longer saves the outputs (the forward body still returns them; they die at its
call). The same ops on the same inputs give the same bits under the FX backend; under a fusing
compiler they are fused into other kernels of the backward.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.fx_utils import call, has_tag, op_overload

__all__ = ["cheap_outputs", "recompute_values"]

_GETITEM = operator.getitem
# Ops that move or convert elements without computing across them (a view op is cheap too).
_MOVES = ("aten::clone", "aten::_to_copy", "prims::convert_element_type", "aten::expand",
          "aten::_unsafe_view", "aten::contiguous")


def _cheap(node: fx.Node) -> bool:
    """An elementwise op or a view: memory-bound work that draws no random numbers."""
    op = op_overload(node)
    if op is None or "rng" in str(node.target) or has_tag(node,
                                                           torch.Tag.nondeterministic_seeded):
        return False
    return op.is_view or has_tag(node, torch.Tag.pointwise) or op.name() in _MOVES


def _view_like(node: fx.Node) -> bool:
    """A view op, or ``_unsafe_view`` (a view at run time that the graph does not mark as one)."""
    op = op_overload(node)
    return op.is_view or op.name() == "aten::_unsafe_view"


def _outputs(body: fx.GraphModule) -> list:
    return list(next(iter(body.graph.find_nodes(op="output"))).args[0])


def _cone(root: fx.Node, stops: set[fx.Node]) -> list[fx.Node]:
    """The nodes that compute ``root`` from the body's inputs and ``stops`` (saved values),
    ``root`` included, unordered."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder" or node in stops and node is not root:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return list(seen)


def cheap_outputs(body: fx.GraphModule, positions: Sequence[int]) -> dict[int, list[fx.Node]]:
    """Among the outputs of the body forward graph ``body`` at ``positions`` (those the
    backward reads), the cheap ones: position -> its cone in graph order. Decided in graph
    order, so that a cone stops at the body's inputs and at the earlier outputs of
    ``positions`` found not cheap (the backward reads them saved whatever else is recomputed),
    and runs through the cheap ones (recomputed with it). A cone holds at least one op that is
    not a view (a view of a saved value frees nothing)."""
    outs = _outputs(body)
    order = {n: i for i, n in enumerate(body.graph.nodes)}
    wanted = {p for p in positions if isinstance(outs[p], fx.Node)
              and outs[p].op == "call_function"}
    stops: set[fx.Node] = {outs[p] for p in positions if isinstance(outs[p], fx.Node)
                           and outs[p].op != "call_function"}
    found: dict[int, list[fx.Node]] = {}
    for p in sorted(wanted, key=lambda q: order[outs[q]]):
        cone = _cone(outs[p], stops)
        if all(n.op == "call_function" and _cheap(n) for n in cone) and not all(
                _view_like(n) for n in cone):
            found[p] = sorted(cone, key=order.__getitem__)
        else:
            stops.add(outs[p])
    return dict(sorted(found.items()))


def _getitem(graph: fx.Graph, call_node: fx.Node, position: int) -> fx.Node:
    for user in call_node.users:
        if user.target is _GETITEM and user.args[1] == position:
            return user
    with graph.inserting_after(call_node):
        return call(graph, _GETITEM, (call_node, position))


def recompute_values(gm: fx.GraphModule, call_node: fx.Node, positions: Sequence[int],
                     read_positions: Sequence[int], checkpoint_id: int) -> int:
    """Recompute the outputs at ``positions`` of the forward body call ``call_node`` (each one
    of :func:`cheap_outputs` among ``read_positions``, every output the backward reads) for
    the backward body calls that read them, from copies of their cones in ``gm``'s graph;
    returns how many outputs the backward no longer reads saved."""
    graph = gm.graph
    body = getattr(gm, call_node.args[0].target)
    cheap = cheap_outputs(body, read_positions)
    if not set(positions) <= set(cheap):
        raise ValueError(f"shardc: outputs {sorted(set(positions) - set(cheap))} of "
                         f"{call_node.name} are not cheap to recompute (a planner bug)")
    cones = {p: cheap[p] for p in positions}
    outs = _outputs(body)
    readers = {}
    for user in call_node.users:
        if user.target is _GETITEM and user.args[1] in cones:
            bw = [u for u in user.users if u.op == "call_function" and u.target is INVOKE_SUBGRAPH]
            if bw:
                readers[user.args[1]] = (user, bw)
    if not readers:
        return 0
    bw_calls = {u for _, bws in readers.values() for u in bws}
    first_reader = next(n for n in graph.nodes if n in bw_calls)
    # The call's operands by the body's placeholders: (subgraph, identifier, *operands).
    operands = dict(zip(body.graph.find_nodes(op="placeholder"), call_node.args[2:]))
    copies: dict[fx.Node, fx.Node] = {}

    def value(node: fx.Node) -> fx.Node:
        if node in copies:
            return copies[node]
        if node.op == "placeholder":
            return operands[node]
        return _getitem(graph, call_node, outs.index(node))

    with graph.inserting_before(first_reader):
        for position in sorted(readers):
            for node in cones[position]:
                if node in copies:
                    continue
                args = fx.node.map_arg(node.args, value)
                kwargs = fx.node.map_arg(node.kwargs, value)
                new = call(graph, node.target, args, kwargs)
                new.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                new.meta["ac_graph_id"] = checkpoint_id
                for key in ("partitioner_tag", "seq_nr", "nn_module_stack"):
                    if key in call_node.meta:
                        new.meta[key] = call_node.meta[key]
                copies[node] = new
    for position, (saved, bws) in readers.items():
        for bw in bws:
            bw.replace_input_with(saved, copies[outs[position]])
    return len(readers)
