"""Gather each parameter once per region and reduce its gradient once.

A parameter read several times in one forward (tied embedding/output weights, a weight used
twice) shows up as several ``gather_param`` nodes and, in the joint graph's backward, several
``reduce_scatter_grad`` nodes whose results autograd adds up. This pass keeps the first gather and
replaces the reductions by one reduction of the summed full gradients, which is the same value
(reduce-scatter is linear) with one collective instead of several.
"""

from __future__ import annotations

import torch
from torch import fx

from shardc.ops.gather import GATHER_OP, REDUCE_SCATTER_OP
from shardc.ops.gather_args import ReduceArgs
from shardc.passes.fx_utils import call


def _nodes_by_key(graph: fx.Graph, target, key) -> dict:
    groups: dict = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is target:
            groups.setdefault(key(node), []).append(node)
    return groups


def dedupe_gathers(graph: fx.Graph) -> int:
    """Merge ``gather_param`` nodes with identical arguments; returns how many were removed."""
    removed = 0
    groups = _nodes_by_key(graph, GATHER_OP, lambda n: (n.args, tuple(n.kwargs.items())))
    for nodes in groups.values():
        keep = nodes[0]
        for dup in nodes[1:]:
            dup.replace_all_uses_with(keep)
            graph.erase_node(dup)
            removed += 1
    return removed


def merge_reduce_scatters(graph: fx.Graph) -> int:
    """Replace several ``reduce_scatter_grad`` nodes of one parameter by one; returns how many went.

    The merged node sits where the last of them was (all contributions exist there); the earlier
    ones become zeros of the shard's shape, which the additions autograd emitted absorb. Those
    additions (everything downstream of the merged node) move to the end of the graph: autograd
    placed them right after the last contribution, which can precede the last gradient of
    another parameter of the same bucket, and the bucket's reduce-scatter is waited only after
    that one exists (its wait must precede every reader of the reduced shards).
    """
    removed = 0
    groups = _nodes_by_key(graph, REDUCE_SCATTER_OP, lambda n: ReduceArgs.of(n).fqn)
    for nodes in groups.values():
        if len(nodes) < 2:
            continue
        last = nodes[-1]
        with graph.inserting_before(last):
            total = ReduceArgs.of(nodes[0]).grad
            for node in nodes[1:]:
                total = call(graph, torch.ops.aten.add.Tensor, (total, ReduceArgs.of(node).grad))
            merged = call(graph, REDUCE_SCATTER_OP, ReduceArgs.of(last).with_grad(total).args())
        last.replace_all_uses_with(merged)
        graph.erase_node(last)
        _move_users_to_end(graph, merged)
        for node in nodes[:-1]:
            shard = node.meta["val"]
            with graph.inserting_before(node):
                # aten.full, not aten.zeros: this graph was already decomposed, and Inductor has
                # no lowering for aten.zeros (it refuses it: "both a fallback and a decomp").
                zeros = call(
                    graph,
                    torch.ops.aten.full.default,
                    (list(shard.shape), 0),
                    {"dtype": shard.dtype, "layout": torch.strided, "device": shard.device,
                     "pin_memory": False},
                )
            node.replace_all_uses_with(zeros)
            graph.erase_node(node)
            removed += 1
    return removed


def _move_users_to_end(graph: fx.Graph, node: fx.Node) -> None:
    """Move every node downstream of ``node`` right before the output, in their order (a set
    closed under users moved later keeps the graph topologically sorted)."""
    downstream, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and user not in downstream:
                downstream.add(user)
                stack.append(user)
    output = graph.find_nodes(op="output")[0]
    for n in [n for n in graph.nodes if n in downstream]:
        output.prepend(n)
