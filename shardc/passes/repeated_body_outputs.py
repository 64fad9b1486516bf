"""Read a body output that its graph returns at two positions through one of them.

A sunk block body (``shardc.passes.sink_residual``) takes the pair ``(a_prev, b_prev)`` and adds
it first; its partitioned backward returns the gradient of that sum for both halves, the same
node at two output positions. Inductor lowers each ``getitem`` of the call's outputs as a buffer
of its own, so the caller holds two names for one storage. After both names' last reads it can
reuse both for two different outputs of one kernel, which then write the same memory (found in
the sixtieth and sixty-first sessions: a sunk body's recomputed part, whose kernel writes two
tensors of the hidden state's size right after the next body's backward, left parameters 4e-5
off the reference; exact with Inductor's ``allow_buffer_reuse`` off). Torch 2.11-2.14 do this.

:func:`read_repeated_outputs_once` makes the caller read such an output at its first position
only: every ``getitem`` of a later position that returns the same node is replaced by the
``getitem`` of the first. Same values, one name per storage; the body and its compiled code are
unchanged.
"""

from __future__ import annotations

import operator

from torch import fx

from shardc.passes.body import body_calls
from shardc.passes.fx_utils import is_call

__all__ = ["read_repeated_outputs_once", "repeated_output_positions"]


def repeated_output_positions(body: fx.GraphModule) -> dict[int, int]:
    """``{later position: first position}`` for each output of ``body`` that its output node
    returns at an earlier position too (the same node)."""
    output = next(iter(body.graph.find_nodes(op="output")))
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        return {}
    first: dict[fx.Node, int] = {}
    later: dict[int, int] = {}
    for position, value in enumerate(values):
        if not isinstance(value, fx.Node):
            continue
        if value in first:
            later[position] = first[value]
        else:
            first[value] = position
    return later


def read_repeated_outputs_once(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s reads of body outputs returned at two positions to read the first
    position (module docstring); returns how many ``getitem`` nodes were replaced or moved.
    Deterministic: the graph alone decides."""
    changed = 0
    order: dict[fx.Node, int] | None = None  # node positions (erasing keeps them comparable)
    by_body: dict[str, dict[int, int]] = {}  # one look per body, not per call
    for call in list(body_calls(gm)):
        target = call.args[0].target
        if target not in by_body:
            by_body[target] = repeated_output_positions(getattr(gm, target))
        later = by_body[target]
        if not later:
            continue
        if order is None:
            order = {node: i for i, node in enumerate(gm.graph.nodes)}
        reads = {u.args[1]: u for u in call.users if is_call(u, operator.getitem)}
        for position, first in sorted(later.items()):
            read = reads.pop(position, None)
            if read is None:
                continue
            kept = reads.get(first)
            if kept is None:
                kept = read
            elif order[kept] > order[read]:
                # The earlier getitem stays: users of it may come before the other one.
                kept.replace_all_uses_with(read)
                gm.graph.erase_node(kept)
                kept = read
            else:
                read.replace_all_uses_with(kept)
                gm.graph.erase_node(read)
            kept.args = (call, first)
            reads[first] = kept
            changed += 1
    return changed
