"""``OffloadPolicy(params="auto")`` with the shards still on the device: no offload copies.

A model sharded with ``params="auto"`` reads every parameter through
``shardc::offload_to_device`` when compiled, so its traced graph is the same wherever its shards
live (:mod:`shardc.sharding.auto_offload`). While they are on the device the copies are not
wanted: this pass removes them from a joint or forward graph before anything is planned, so the
graph is the one the model sharded without offload traces. The forward's copy becomes the shard
itself; the backward's copy to the host (traced where the shard is a host tensor, as on a CPU
mesh simulating offload) becomes the gradient, cast to the shard's dtype where it differs.
"""

from __future__ import annotations

import contextlib

import torch
from torch import fx

from shardc import _torch
from shardc.ops.offload_copy import is_to_device, is_to_host

_CAST = torch.ops.prims.convert_element_type.default


def drop_offload_copies(graph: fx.Graph) -> int:
    """Replace every ``offload_to_device`` node by its shard and every ``offload_to_host``
    node by its gradient (cast to the node's dtype where it differs); returns how many went."""
    dropped = 0
    for node in list(graph.nodes):
        if is_to_device(node):
            node.replace_all_uses_with(node.args[0])
        elif is_to_host(node):
            node.replace_all_uses_with(_as_dtype(graph, node, node.args[0], node.args[2]))
        else:
            continue
        graph.erase_node(node)
        dropped += 1
    return dropped


def _as_dtype(graph: fx.Graph, where: fx.Node, grad: fx.Node, dtype: torch.dtype) -> fx.Node:
    val = grad.meta.get("val")
    if val is not None and val.dtype == dtype:
        return grad
    with graph.inserting_before(where):
        cast = graph.call_function(_CAST, (grad, dtype))
    if val is not None:
        with _torch.detect_fake_mode([val]) or contextlib.nullcontext():
            cast.meta["val"] = val.to(dtype)
    return cast

