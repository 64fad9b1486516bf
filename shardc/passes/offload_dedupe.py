"""CPU offload: copy each parameter's host shard to the device once per graph.

A parameter read several times in one forward (tied weights) is copied once per read, so its
gathers differ in their first argument and :func:`shardc.passes.dedupe.dedupe_gathers` could
not merge them; merging the copies first makes the gathers identical.
"""

from __future__ import annotations

from torch import fx

from shardc.ops.offload_copy import is_to_device


def dedupe_device_copies(graph: fx.Graph) -> int:
    """Merge ``offload_to_device`` nodes with identical arguments; returns how many went."""
    kept: dict[tuple, fx.Node] = {}
    removed = 0
    for node in list(graph.nodes):
        if not is_to_device(node):
            continue
        key = (node.args, tuple(node.kwargs.items()))
        if key in kept:
            node.replace_all_uses_with(kept[key])
            graph.erase_node(node)
            removed += 1
        else:
            kept[key] = node
    return removed
