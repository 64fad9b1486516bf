"""Apply a :class:`shardc.plan.Plan` to a partitioned graph: flat bucketed collectives.

Each all-gather packs the bucket's shards (cast to the communication dtype, padded to the common
row count, flattened) into one buffer, issues ``all_gather_into_tensor`` at the planned position,
waits at the planned position and copies each parameter out of the gathered buffer. Each
reduce-scatter packs the bucket's full gradients rank-major into one buffer, issues
``reduce_scatter_tensor``, and at its wait divides by the world size and slices out this rank's
rows of every parameter. Collectives are torch functional collectives, so NCCL and gloo, eager FX
and Inductor all run them.
"""

from __future__ import annotations

import torch
from torch import fx

from shardc.passes.fx_utils import call
from shardc.passes.schedule import GraphComm, analyze, view_chain_root, view_users
from shardc.plan import Bucket, Collective, Plan
from shardc.runtime.collectives import shard_rows

aten = torch.ops.aten
funcol = torch.ops._c10d_functional


def _anchor(g: GraphComm, gm: fx.GraphModule, pos: int) -> fx.Node:
    return g.compute[pos] if pos < g.end else gm.graph.find_nodes(op="output")[0]



def _pad_rows(graph: fx.Graph, x: fx.Node, rows: int) -> fx.Node:
    val = x.meta["val"]
    pad = [0, 0] * (val.dim() - 1) + [0, rows - int(val.shape[0])]
    return call(graph, aten.constant_pad_nd.default, (x, pad, 0.0))


def _retake_views(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A copy, at the insertion point, of the chain of views from a placeholder to ``node``."""
    if node.op == "placeholder":
        return node
    base = _retake_views(graph, node.all_input_nodes[0])
    return graph.node_copy(node, lambda n: base)


def _issue_all_gather(graph, c: Collective, bucket: Bucket, gathers: dict, group: str) -> fx.Node:
    pieces = []
    layout, _ = bucket.layout(c.params)
    for fqn in c.params:
        gather = gathers[fqn]
        shard, compute_dtype = gather.args[0], gather.args[5]
        x = _retake_views(graph, shard) if view_chain_root(shard) is not None else shard
        if compute_dtype is not None and compute_dtype != shard.meta["val"].dtype:
            x = call(graph, torch.ops.prims.convert_element_type.default, (x, compute_dtype))
        _, rows, _, _ = layout[fqn]
        x = _pad_rows(graph, x, rows)
        pieces.append(call(graph, aten.view.default, (x, [-1])))
    send = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, (pieces,))
    return call(graph, funcol.all_gather_into_tensor.default, (send, bucket.world, group))


def _wait_all_gather(graph, c: Collective, bucket: Bucket, gathers: dict, handle: fx.Node):
    done = call(graph, funcol.wait_tensor.default, (handle,))
    layout, total = bucket.layout(c.params)
    table = call(graph, aten.view.default, (done, [bucket.world, total]))
    for fqn in c.params:
        gather = gathers[fqn]
        offset, rows, row_numel, dim0 = layout[fqn]
        cols = call(graph, aten.slice.Tensor, (table, 1, offset, offset + rows * row_numel))
        dense = call(graph, aten.clone.default, (cols,), {"memory_format": torch.contiguous_format})
        shape = list(gather.meta["val"].shape)
        full = call(graph, aten.view.default, (dense, [bucket.world * rows, *shape[1:]]))
        full = call(graph, aten.slice.Tensor, (full, 0, 0, dim0))
        gather.replace_all_uses_with(full)
        graph.erase_node(gather)


def _issue_reduce_scatter(graph, c: Collective, bucket: Bucket, reduces: dict, group: str):
    pieces = []
    layout, _ = bucket.layout(c.params)
    for fqn in c.params:
        rs = reduces[fqn]
        grad, reduce_dtype = rs.args[0], rs.args[5]
        x = grad
        if reduce_dtype is not None and reduce_dtype != grad.meta["val"].dtype:
            x = call(graph, torch.ops.prims.convert_element_type.default, (x, reduce_dtype))
        _, rows, row_numel, _ = layout[fqn]
        x = _pad_rows(graph, x, rows * bucket.world)
        pieces.append(call(graph, aten.view.default, (x, [bucket.world, rows * row_numel])))
    packed = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, (pieces, 1))
    flat = call(graph, aten.view.default, (packed, [-1]))
    return call(graph, funcol.reduce_scatter_tensor.default, (flat, "sum", bucket.world, group))


def _wait_reduce_scatter(graph, c: Collective, bucket: Bucket, reduces: dict, handle, rank: int):
    done = call(graph, funcol.wait_tensor.default, (handle,))
    if bucket.world > 1:
        done = call(graph, aten.div.Tensor, (done, bucket.world))
    layout, _ = bucket.layout(c.params)
    for fqn in c.params:
        rs = reduces[fqn]
        offset, rows, row_numel, dim0 = layout[fqn]
        shape = list(rs.meta["val"].shape)
        piece = call(graph, aten.slice.Tensor, (done, 0, offset, offset + rows * row_numel))
        piece = call(graph, aten.view.default, (piece, [rows, *shape[1:]]))
        piece = call(graph, aten.slice.Tensor, (piece, 0, 0, shard_rows(dim0, bucket.world, rank)))
        out_dtype = rs.args[6]
        if out_dtype != piece.meta["val"].dtype:
            piece = call(graph, torch.ops.prims.convert_element_type.default, (piece, out_dtype))
        views, _ = view_users(rs)
        rs.replace_all_uses_with(piece)
        graph.erase_node(rs)
        # Views of the reduced shard (e.g. re-wrapping it as the DTensor gradient) may sit
        # before the wait; move them behind it, in their original order.
        anchor = piece
        for node in [n for n in graph.nodes if n in set(views)]:
            anchor.append(node)
            anchor = node


def apply_plan(gm: fx.GraphModule, plan: Plan, graph_name: str, rank: int) -> fx.GraphModule:
    """Replace the shardc nodes of ``gm`` (the region's ``graph_name`` graph) by ``plan``."""
    g = analyze(gm, graph_name)
    colls = [c for c in plan.collectives if c.graph == graph_name]
    handles: dict[str, fx.Node] = {}
    graph = gm.graph
    # Issues before waits at the same position, each group in plan order.
    for c in sorted(colls, key=lambda c: c.issue_pos):
        bucket = plan.buckets[c.bucket]
        source = g.gathers if c.kind == "all_gather" else g.reduces
        group = source[c.params[0]].args[4]
        with graph.inserting_before(_anchor(g, gm, c.issue_pos)):
            if c.kind == "all_gather":
                handles[c.id] = _issue_all_gather(graph, c, bucket, g.gathers, group)
            else:
                handles[c.id] = _issue_reduce_scatter(graph, c, bucket, g.reduces, group)
    for c in sorted(colls, key=lambda c: c.wait_pos):
        bucket = plan.buckets[c.bucket]
        with graph.inserting_before(_anchor(g, gm, c.wait_pos)):
            if c.kind == "all_gather":
                _wait_all_gather(graph, c, bucket, g.gathers, handles[c.id])
            else:
                _wait_reduce_scatter(graph, c, bucket, g.reduces, handles[c.id], rank)
    graph.lint()
    gm.recompile()
    return gm
