"""Block bodies that Dynamo traced as two equal subgraphs, called as one (Dynamo's graph, before
AOTAutograd).

torch 2.11's Dynamo traces every call of a guard-based ``nested_compile_region`` and keeps one
subgraph per distinct graph it sees. Under dynamic shapes it kept the first block's body apart
from the later blocks' one although the two graphs run the same operations on inputs of the same
sizes, strides and dtypes (the first differs only in its placeholders' names). AOTAutograd would
then partition, and Inductor compile, the same body twice, and shardc's record could not tell
the two bodies' partitions apart (their joint graphs have the same input signature).

:func:`share_equal_bodies` compares the subgraphs of the region's body calls by
:func:`graph_form` (operations, constants and how nodes feed each other, the placeholders'
values, nested subgraphs compared the same way) and points each call whose subgraph equals an
earlier call's in the same graph at that earlier subgraph and its identifier. On torch 2.13,
whose Dynamo keys or deduplicates the bodies itself, it finds nothing to change.
"""

from __future__ import annotations

import torch
from torch import fx

from shardc import _torch
from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.fx_utils import subgraph_module

__all__ = ["INVOKE_SUBGRAPH", "graph_form", "share_equal_bodies"]


def _value_form(value: object) -> tuple:
    """A placeholder's value as compared: a tensor's sizes, strides (symbolic ones by their
    expressions, which name the region's own symbols), dtype, device and requires_grad."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(tuple(value.shape)), str(value.stride()), value.dtype,
                value.device, value.requires_grad)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("symbol", type(value).__name__, str(value))
    return ("other", type(value).__name__, repr(value))


def graph_form(gm: fx.GraphModule) -> tuple | None:
    """What two subgraphs must share to be called as one: per node, its kind, its target (a
    nested subgraph by its own form and its selective checkpointing policy), its arguments
    (other nodes by position) and, for placeholders, their values. None when a node reads an
    attribute that is not a subgraph (a constant of its own: such subgraphs are never
    shared)."""
    index: dict[fx.Node, int] = {}
    nodes = []
    for node in gm.graph.nodes:
        index[node] = len(index)
        if node.op == "placeholder":
            value = node.meta.get("example_value", node.meta.get("val"))
            nodes.append(("placeholder", _value_form(value)))
            continue
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            form = graph_form(sub) if isinstance(sub, fx.GraphModule) else None
            if form is None:
                return None
            # A checkpointed region's selective policy lives on its subgraph, not in its
            # nodes: the same policy object or none.
            policy = _torch.selective_checkpoint_policy(sub)
            nodes.append(("get_attr", form, None if policy is None else id(policy)))
            continue
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", index[n]))
        nodes.append((node.op, node.target, args))
    return tuple(nodes)


def _equal(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a constant without a plain equality (a tensor): never shared
        return False


def share_equal_bodies(calls: list[fx.Node]) -> int:
    """Point each ``invoke_subgraph`` call of ``calls`` (the region's body calls) whose subgraph
    equals (:func:`graph_form`) that of an earlier call in the same graph at the earlier call's
    subgraph and identifier; remove the subgraphs no call uses any more. Returns how many calls
    were changed."""
    # Compared by equality, not hashed: a form holds whatever constants the graph's calls
    # take (slices are not hashable); a region has few distinct bodies.
    firsts: list[tuple[int, tuple, fx.Node]] = []
    forms: dict[int, tuple | None] = {}
    changed = 0
    touched: set[fx.GraphModule] = set()
    for call in calls:
        sub = subgraph_module(call)
        if sub is None:
            continue
        owner = call.graph.owning_module
        if id(sub) not in forms:
            forms[id(sub)] = graph_form(sub)
        form = forms[id(sub)]
        if form is None:
            continue
        first = next((c for o, f, c in firsts if o == id(owner) and _equal(f, form)), None)
        if first is None:
            firsts.append((id(owner), form, call))
            continue
        if first.args[0].target == call.args[0].target:
            continue
        old = call.args[0]
        call.args = (first.args[0], first.args[1], *call.args[2:])
        if not old.users:
            call.graph.erase_node(old)
            if not any(n.op == "get_attr" and n.target == old.target
                       for n in call.graph.nodes):
                owner.delete_submodule(old.target)
        touched.add(owner)
        changed += 1
    for owner in touched:
        owner.graph.lint()
        owner.recompile()
    return changed
