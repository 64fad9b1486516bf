"""Call a pruned copy of a body where only some of its outputs are read (a partitioned graph).

When a block is recomputed (``shardc.passes.recompute``), the min-cut partitioner copies the
block's forward body call into the backward graph whole: the backward runs the same compiled
forward body again and reads only the activations the block's backward body needs. The body also
computes the block's output, which no one reads there; for a transformer block that is its last
matmul (the MLP's down projection) and the residual add, about a seventh of the block's forward
matmul work, paid again in every recomputed block's backward (measured on an H200: the planner's
recompute was 4.8% slower per token than the same blocks under ``torch.utils.checkpoint``, whose
partition recomputes only what the backward reads).

:func:`prune_unused_body_outputs` gives such a call a copy of its body that returns only the
outputs read, with what only the others needed removed. Every call with the same body and the
same outputs read shares one copy (one subgraph, compiled once), under an identifier of its own
(Inductor reuses a compiled subgraph by attribute name, and looks a body's effects up by
identifier). A call whose unread outputs cost nothing to compute (inputs passed through, values
the read ones need anyway) is left as it is.
"""

from __future__ import annotations

import operator

from torch import fx

from shardc.passes.body import (
    add_body_variant,
    body_calls,
    call_body_variant,
    calls_by_marked_body,
    drop_body_call,
)
from shardc.passes.fx_utils import is_call

__all__ = ["pruned_body_note", "prune_unused_body_outputs"]

_PRUNED = "shardc_pruned_from"  # a pruned body's meta: (full body, outputs, read, ops, kept)


def prune_unused_body_outputs(gm: fx.GraphModule) -> int:
    """Rewrite the body calls of ``gm`` whose outputs are partly unread to call a pruned body
    (module docstring); returns how many calls were rewritten. Deterministic: the same graph
    gets the same names and identifiers on every rank."""
    variants: dict[tuple[str, tuple[int, ...]], tuple[fx.Node, str] | None] = {}
    count = 0
    for node in list(body_calls(gm)):
        used = _read_outputs(node)
        if used is None:
            continue
        attr = node.args[0]
        key = (str(attr.target), used)
        if key not in variants:
            variants[key] = _add_variant(gm, node, used, len(variants))
        if variants[key] is not None:
            _rewire(gm, node, used, *variants[key])
            count += 1
    return count


def _read_outputs(node: fx.Node) -> tuple[int, ...] | None:
    """The output positions of body call ``node`` that are read, or None when all are (or when
    the call is read other than through ``getitem``)."""
    if not all(is_call(u, operator.getitem) for u in node.users):
        return None
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)):
        return None
    used = tuple(sorted({u.args[1] for u in node.users}))
    return None if len(used) == len(val) else used


def _add_variant(gm: fx.GraphModule, node: fx.Node, used: tuple[int, ...], index: int
                 ) -> tuple[fx.Node, str] | None:
    """Register the pruned copy of ``node``'s body (outputs ``used``) on ``gm`` with a
    ``get_attr`` node right after the original's; None if pruning removes no computation."""
    body = getattr(gm, node.args[0].target)
    graph = fx.Graph()
    outputs = graph.graph_copy(body.graph, {})
    old_out = next(iter(body.graph.find_nodes(op="output")))
    out = graph.output(tuple(outputs[i] for i in used))
    if "val" in old_out.meta:
        out.meta["val"] = tuple(old_out.meta["val"][i] for i in used)
    graph.eliminate_dead_code()
    if _computed(graph) == _computed(body.graph):
        return None
    attr = add_body_variant(gm, node, graph, "pruned", _PRUNED, (
        str(node.args[0].target), len(outputs), len(used), _computed(body.graph),
        _computed(graph)))
    return attr, f"{node.args[1]}_pruned_{index}"


def pruned_body_note(gm: fx.GraphModule) -> str | None:
    """The plan's note on ``gm``'s calls of pruned bodies (None if it has none): per pruned
    body, how many calls, the outputs and ops kept of the full body's."""
    calls = calls_by_marked_body(gm, _PRUNED)
    if not calls:
        return None
    parts = []
    for target, count in calls.items():
        full, outputs, read, ops, kept = getattr(gm, target).meta[_PRUNED]
        parts.append(f"{count} call(s) of {full} read {read} of its {outputs} outputs and run "
                     f"a copy that computes only those ({kept} of its {ops} ops)")
    return ("pruned bodies: the backward calls forward bodies again (recomputed blocks); "
            + "; ".join(parts) + " (shardc.passes.prune_body_outputs)")


def _computed(graph: fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function")


def _rewire(gm: fx.GraphModule, node: fx.Node, used: tuple[int, ...], attr: fx.Node,
            identifier: str) -> None:
    new = call_body_variant(gm, node, attr, identifier,
                            tuple(node.meta["val"][i] for i in used))
    position = {old: i for i, old in enumerate(used)}
    for user in list(node.users):
        user.args = (new, position[user.args[1]])
    drop_body_call(gm, node)
