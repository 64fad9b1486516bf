"""Give every body call its operands in the layouts its subgraph was traced for.

A partitioned body is compiled once for the layouts its placeholders were traced with, and every
call of it must pass those: Inductor's fake-tensor update after its post-grad passes refuses a
subgraph whose calls pass one operand in two layouts ("subgraph args must have consistent
values", torch 2.13), and on torch 2.11 the compiled body's stride assertions fail at run time.
Inductor's own joint-graph passes can break that before shardc partitions: a loss
``(y * torch.ones(1, 1, d)).sum()`` gives the last block the gradient ``expand(g) * ones``,
which its pattern passes reduce to ``expand(g)`` (strides 0), while the body's backward was
traced for a dense gradient (plain ``torch.compile`` with ``nested_compile_region`` fails the
same way on torch 2.11 and 2.13; found in s65, ``docs/bench/standin_s65/loss_layouts.py``).

:func:`copy_operands_into_traced_layouts` copies each operand whose layout differs from its
placeholder's only in static strides or offset into the placeholder's layout
(``prims.copy_strided``): the same values, one copy of that operand. Operands that differ
otherwise, or with symbolic sizes or strides, are left for torch to report. An ``expand``
operand has its layout computed again from its input: a pattern replacement can leave the value
of the node it replaced on it (the ``expand`` above carried the dense product's).

The other way round, a placeholder traced for an overlapping layout (an ``expand``: the last
block's gradient where the loss sums its output over a dimension, ``x.sum(1)``) cannot be
copied into: no other call's values fit it (torch's ``nested_compile_region`` traces a second
backward for such a tangent; shardc's later calls reuse the first). :func:`_densify_placeholders`
makes such a placeholder dense (contiguous) and computes the body's fake values again from it,
and then every call's operand is copied into that layout as above (the expanded one too); the
calls' ``eager_input_vals``, to which Inductor's ``invoke_subgraph`` lowering constrains each
operand, take the dense values as well (a block that returns an expand: its next call's
forward operand was constrained back to the expand's layout).
"""

from __future__ import annotations

import torch
from torch import fx

from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.fx_utils import (
    call,
    fake_mode_of,
    is_call,
    overlapping,
    recomputed_value,
    static_layout,
)

__all__ = ["copy_operands_into_traced_layouts"]


def _needs_copy(traced: tuple | None, given: tuple | None) -> bool:
    """Whether an operand laid out as ``given`` must be copied into ``traced``: both static,
    the same sizes, dtype and device, other strides or offset."""
    if traced is None or given is None or traced == given:
        return False
    return (traced[0], traced[3], traced[4]) == (given[0], given[3], given[4])


def _given_layout(graph: fx.Graph, operand: fx.Node) -> tuple | None:
    """The layout ``operand`` has: for an ``expand``, computed again from its input's fake value
    (and its value set to it), else its recorded fake value's. (Only ``expand`` was seen to
    carry a replaced node's value; recomputing every view operand of every call cost 0.1 s at
    64 blocks on the 2-core CPU, a compile-time cost per block.)"""
    if is_call(operand, torch.ops.aten.expand.default):
        value = recomputed_value(graph, operand)
        if isinstance(value, torch.Tensor):
            operand.meta["val"] = value
    return static_layout(operand.meta.get("val"))


def _densify_placeholders(body: fx.GraphModule, placeholders: list[fx.Node]) -> bool:
    """Give each of ``body``'s ``placeholders`` traced in an overlapping static layout a
    contiguous one, and recompute the fake values of the nodes after them (those torch cannot
    evaluate keep theirs); False where there is none, or no fake mode to do it in."""
    dense = [p for p in placeholders if overlapping(static_layout(p.meta.get("val")))]
    mode = fake_mode_of(body.graph)
    if not dense or mode is None:
        return False
    with mode:
        for p in dense:
            value = p.meta["val"]
            p.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    for node in body.graph.nodes:
        if node.op == "call_function":
            value = recomputed_value(body.graph, node)
            if value is not None:
                node.meta["val"] = value
    return True


def copy_operands_into_traced_layouts(gm: fx.GraphModule) -> int:
    """Copy each operand of each body call in ``gm`` that its subgraph's placeholder was traced
    in another static layout for into that layout (module docstring); returns how many were
    copied. Deterministic: the graph alone decides."""
    copied = 0
    placeholders_of: dict[str, list[fx.Node] | None] = {}  # one look per body, not per call
    densified: set[str] = set()  # the bodies whose placeholders _densify_placeholders changed
    for node in [n for n in gm.graph.nodes if is_call(n, INVOKE_SUBGRAPH)]:
        target = node.args[0].target
        if target not in placeholders_of:
            body = getattr(gm, target, None)
            placeholders_of[target] = list(body.graph.find_nodes(op="placeholder")) \
                if isinstance(body, fx.GraphModule) else None
            if placeholders_of[target] is not None and _densify_placeholders(
                    body, placeholders_of[target]):
                densified.add(target)
        placeholders = placeholders_of[target]
        operands = list(node.args[2:])
        if placeholders is None or len(placeholders) != len(operands):
            continue
        for i, (placeholder, operand) in enumerate(zip(placeholders, operands, strict=True)):
            if not isinstance(operand, fx.Node):
                continue
            traced = placeholder.meta.get("val")
            if not _needs_copy(static_layout(traced), _given_layout(gm.graph, operand)):
                continue
            with gm.graph.inserting_before(node):
                operands[i] = call(gm.graph, torch.ops.prims.copy_strided.default,
                                   (operand, list(traced.stride())))
            copied += 1
        node.args = (*node.args[:2], *operands)
        if target in densified:
            _eager_values_as_placeholders(node, placeholders)
    if copied:
        gm.recompile()
    return copied


def _eager_values_as_placeholders(node: fx.Node, placeholders: list[fx.Node]) -> None:
    """A call of a body whose placeholders were made dense: the values its operands had when
    traced (``meta["eager_input_vals"]``, ``(subgraph, identifier, *operands)``), which
    Inductor's ``invoke_subgraph`` lowering constrains each operand to, become the placeholders'
    (an expanded one would be constrained back to the expand's layout)."""
    vals = node.meta.get("eager_input_vals")
    if vals is None:
        return
    args, kwargs = vals
    if len(args) != 2 + len(placeholders):
        node.meta.pop("eager_input_vals")  # Inductor then reads the operands' values
        return
    node.meta["eager_input_vals"] = (
        (*args[:2], *(p.meta.get("val") for p in placeholders)), kwargs)
