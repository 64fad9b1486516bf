"""The region traced again after the planner moved the parameter shards to the host.

``OffloadPolicy(params="auto")`` (:mod:`shardc.sharding.auto_offload`): when a region's peak
budget is refused by every other lever, the backend moves the shards and compiles the same
Dynamo graph again; AOTAutograd must then trace each moved parameter as the host tensor it now
is. This module finds those parameters among the graph's inputs and has them fakified anew.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import fx

from shardc import _torch
from shardc.ops.offload_copy import copied_shard, copy_fqn, is_to_device
from shardc.sharding import auto_offload

if TYPE_CHECKING:
    from shardc.sharding.shard import ShardState


def host_example_inputs(gm: fx.GraphModule, example_inputs: Sequence[object],
                         state: ShardState) -> list:
    """``example_inputs`` for the region traced again after the planner moved the parameter
    shards to the host: each moved parameter's input (the parameter itself, as torch hands it
    to backends, or a fake of it) fakified anew, so that AOTAutograd traces a host shard. Dynamo's
    fake mode remembers the fake it made of the parameter, on the device: without
    :func:`_torch.forget_fake` it hands that one back. A parameter input is found as the
    placeholder its ``offload_to_device`` read starts from."""
    inputs = list(example_inputs)
    fake_mode = _torch.detect_fake_mode(inputs)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {node: i for i, node in enumerate(placeholders)}
    root = state.root()
    moved: set[int] = set()
    for graph_module in gm.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            if not is_to_device(node):
                continue
            source = placeholder_of(copied_shard(node))
            if source is None or source not in index or index[source] >= len(inputs):
                continue
            i = index[source]
            if i in moved:
                continue
            param = auto_offload.sharded_param(root, copy_fqn(node))
            _torch.forget_fake(fake_mode, param)
            if _torch.is_fake(inputs[i]):
                inputs[i] = _torch.fake_of(fake_mode, param)
                source.meta["example_value"] = inputs[i]
            moved.add(i)
    if not moved:
        # Traced again with the shards' old fakes, the region's backward would hand device
        # gradients to host parameters (autograd refuses them deep in its engine): say so here.
        raise RuntimeError(
            "shardc: the peak budget moved the parameter shards to the host "
            "(OffloadPolicy(params='auto')), but no parameter read of this region's graph "
            "was found to trace it again with them there; shard with OffloadPolicy() instead.")
    return inputs


def placeholder_of(node) -> fx.Node | None:
    """The placeholder a chain of first arguments (a DTensor's ``to_local``) starts from."""
    while isinstance(node, fx.Node) and node.op != "placeholder":
        node = node.args[0] if node.args else None
    return node if isinstance(node, fx.Node) else None
