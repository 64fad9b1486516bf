"""Cast a body's output inside the body where the outer graph only casts it (a lowered graph).

In a one-rank group (world 1) the gradient a block's backward body returns for its gathered
weights is not reduce-scattered: lowering casts it to the reduce dtype
(``shardc.passes.lower.elide``) right after the body call. Inductor compiles the body and the
outer graph apart, so the body writes its gradient buffer in the compute dtype (a packed block's
``cat`` of its weights' gradients, ``PackedLayout.unpack``'s backward) and the outer graph reads
it again to write the cast: two passes over the block's gradient where one would do (s72, one
H100, 1b llama at 16 layers: 1.8 + 1.6 ms a step for the two, against 1.55 ms for the bound's
one cast per weight; s73, the same runs: the step's fused kernels 17.2 -> 15.6 ms with this and
the unpack's split, docs/overhead.md).

:func:`cast_body_outputs_inside` gives such calls a copy of their body that returns the cast
value, the cast pushed through a ``cat`` (and views of it) to the cat's inputs, so Inductor
computes each input's cast straight into its slice of the result; the outer cast is removed.
The values are the same (a cast is elementwise); every call of a body shares one copy (one
subgraph, compiled once) that makes the casts all of them make, as
``shardc.passes.prune_body_outputs`` shares pruned bodies.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc.passes.body import (
    add_body_variant,
    body_calls,
    call_body_variant,
    calls_by_marked_body,
    drop_body_call,
)
from shardc.passes.fx_utils import call, is_call, is_view

__all__ = ["ONE_RANK_GRAD_CAST", "body_output_casts_note", "cast_body_outputs_inside"]

_CAST = torch.ops.prims.convert_element_type.default
_CAT = torch.ops.aten.cat.default
_CASTS_INSIDE = "shardc_casts_inside"  # a variant body's meta: (full body, {output: dtype})
# The meta lowering puts on a one-rank group's gradient cast (``lower.elide``): the casts moved.
# Others stay: above one rank the FX path casts a gradient before packing its send buffer, and
# the peak model counts a cast pushed through a cat as buffers of their own, which Inductor
# writes into the cat (the planner predicted 0.13 MiB more for a tiny llama at world 8).
ONE_RANK_GRAD_CAST = "shardc_one_rank_grad_cast"


def cast_body_outputs_inside(gm: fx.GraphModule) -> int:
    """Rewrite the body calls of ``gm`` whose outputs the graph only casts to call a copy of
    the body that casts them itself (module docstring); returns how many casts moved.
    Deterministic: the same graph gets the same names and identifiers on every rank."""
    calls = [(node, _only_casts(node)) for node in body_calls(gm)]
    # One copy per body: the casts every call of it makes (a call that casts more keeps those
    # outside, where a second copy would be a second compile of the body).
    common: dict[str, set] = {}
    for node, casts in calls:
        found = {(i, cast.args[1]) for i, cast in casts.items()}
        target = str(node.args[0].target)
        common[target] = common[target] & found if target in common else found
    variants: dict[str, tuple[fx.Node, str]] = {}
    moved = 0
    for node, casts in calls:
        target = str(node.args[0].target)
        dtypes = dict(sorted(common[target]))
        if not dtypes:
            continue
        if target not in variants:
            variants[target] = _add_variant(gm, node, dtypes, len(variants))
        _rewire(gm, node, {i: casts[i] for i in dtypes}, *variants[target])
        moved += len(dtypes)
    return moved


def _only_casts(node: fx.Node) -> dict[int, fx.Node]:
    """The outputs of body call ``node`` that the graph reads only through one cast each
    (``getitem`` then a one-rank gradient's ``convert_element_type``): output position to the
    cast."""
    val = node.meta.get("val")
    if not isinstance(val, (tuple, list)) or not all(
            is_call(u, operator.getitem) for u in node.users):
        return {}
    casts = {}
    for item in node.users:
        users = list(item.users)
        if len(users) == 1 and is_call(users[0], _CAST) and users[0].args[0] is item \
                and users[0].meta.get(ONE_RANK_GRAD_CAST) \
                and isinstance(val[item.args[1]], torch.Tensor):
            casts[item.args[1]] = users[0]
    return casts


def _add_variant(gm: fx.GraphModule, node: fx.Node, dtypes: dict[int, torch.dtype],
                 index: int) -> tuple[fx.Node, str]:
    """Register the copy of ``node``'s body that casts outputs ``dtypes`` on ``gm``, with a
    ``get_attr`` node right after the original's."""
    body = getattr(gm, node.args[0].target)
    graph = fx.Graph()
    outputs = list(graph.graph_copy(body.graph, {}))
    old_out = next(iter(body.graph.find_nodes(op="output")))
    for i, dtype in dtypes.items():
        outputs[i] = _cast_through_cat(graph, outputs[i], dtype, outputs.count(outputs[i]) == 1)
    out = graph.output(tuple(outputs))
    if "val" in old_out.meta:
        out.meta["val"] = tuple(o.meta.get("val") if isinstance(o, fx.Node) else o
                                for o in outputs)
    graph.eliminate_dead_code()
    attr = add_body_variant(gm, node, graph, "cast", _CASTS_INSIDE,
                            (str(node.args[0].target), dict(dtypes)))
    return attr, f"{node.args[1]}_cast_{index}"


def _cast_through_cat(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, alone: bool
                      ) -> fx.Node:
    """``value`` cast to ``dtype``: where it is a chain of single-input views of a ``cat``,
    the cat's inputs are cast and the cat and views taken again, so that each input's cast is
    written straight into its slice (Inductor's ``ConcatKernel``). ``alone``: ``value`` is
    no other output too."""
    views, walk = [], value
    if alone and not value.users:  # (read by the output alone, which is not made yet)
        while is_view(walk) and len(walk.all_input_nodes) == 1 and len(walk.users) <= 1:
            views.append(walk)
            walk = walk.all_input_nodes[0]
    if not (is_call(walk, _CAT) and len(walk.users) == (1 if views else 0)):
        return call(graph, _CAST, (value, dtype))
    pieces = [call(graph, _CAST, (piece, dtype)) for piece in walk.args[0]]
    new = call(graph, _CAT, (pieces, *walk.args[1:]), dict(walk.kwargs))
    for view in reversed(views):
        new = _retake_view(graph, view, new)
    return new


def _retake_view(graph: fx.Graph, view: fx.Node, source: fx.Node) -> fx.Node:
    """``view`` taken again of ``source`` (a cast of its input)."""
    args = fx.map_arg(view.args, lambda n: source if n is view.all_input_nodes[0] else n)
    return call(graph, view.target, args, dict(view.kwargs))


def _rewire(gm: fx.GraphModule, node: fx.Node, casts: dict[int, fx.Node], attr: fx.Node,
            identifier: str) -> None:
    vals = list(node.meta["val"])
    for i, cast in casts.items():
        vals[i] = cast.meta["val"]
    new = call_body_variant(gm, node, attr, identifier, tuple(vals))
    for item in list(node.users):
        item.args = (new, item.args[1])
        cast = casts.get(item.args[1])
        if cast is not None:
            item.meta["val"] = cast.meta["val"]
            cast.replace_all_uses_with(item)
            gm.graph.erase_node(cast)
    drop_body_call(gm, node)


def body_output_casts_note(gm: fx.GraphModule) -> str | None:
    """The plan's note on ``gm``'s calls of bodies that cast their outputs (None if none)."""
    calls = calls_by_marked_body(gm, _CASTS_INSIDE)
    if not calls:
        return None
    parts = []
    for target, count in calls.items():
        full, dtypes = getattr(gm, target).meta[_CASTS_INSIDE]
        casts = ", ".join(f"output {i} to {str(d).removeprefix('torch.')}"
                          for i, d in sorted(dtypes.items()))
        parts.append(f"{count} call(s) of {full} cast {casts} inside the body")
    return ("body output casts: where the graph only cast a body's output (a one-rank group's "
            "gradient to the reduce dtype), the body casts it, so Inductor writes the cast "
            "where the body wrote its result; " + "; ".join(parts)
            + " (shardc.passes.body_output_casts)")
