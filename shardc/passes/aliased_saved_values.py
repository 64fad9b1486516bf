"""Save one view per storage: derive the other views of a saved value in the backward.

The forward can save two views of one tensor for the backward: a block with attention saves its
attention output ``out`` as the output projection's input, ``view(view(transpose(out)))``, and
as the attention backward's ``out``, ``detach(detach(out))``. shardc's Llama does so in every
layer under the FX backend (inline blocks in the region's own graph, compiled-once blocks as
two outputs of the body call); under Inductor the partition recomputes the view instead, and no
Inductor test of recompute or sinking was found to save the pair. The backward receives such a
pair as two inputs: the peak prediction and the budget planner counted two tensors. And where
a pair reaches Inductor, AOTAutograd donates both to the backward (it does not compare saved
tensors with each other, ``collect_fw_donated_buffer_idxs``) and Inductor lowers every output
of a body call as a buffer of its own (``ir.InvokeSubgraph.create``), so after their last reads
the backward may reuse both names' storage for two buffers live at once: one memory for two
tensors, rare (an allocation of exactly that size) and silent (docs/design.md, "Aliased body
outputs"; the same body node at two output positions is
``shardc.passes.repeated_body_outputs``).

:func:`save_one_view_per_storage` groups the saved values by the value they are views of (a
forward node, or, for a body call's output, the body value the output is a view of), keeps in
each group the one laid out as that value (same sizes, strides and offset: ``detach(detach(
out))``), and drops the others from the saved values: the backward computes each from the kept
one by the same view ops the forward applied to the value. Inductor then sees one input buffer
and views of it, so one storage has one name. The values are the same (a view is an index map
of the same memory) and the bytes held too.

Left as they are: a group without a member laid out as the value (no view to start from), and
a view whose ops take symbolic sizes (dynamic shapes; the sizes would have to be rebuilt in the
backward). ``select``s of a packed query/key/value projection (nn.MultiheadAttention's) form
such a group; their storages do not overlap, so they are harmless either way.

The same hazard within one graph: :func:`read_body_views_through_their_base`. A body call can
return a value and a view of it where the graph reads one and saves the other: a sunk block
whose first op is a linear layer returns the sum of its input pair (the next call's input, or,
for the last call, what the region adds to the last pair) and saves that sum's 2-D view for its
weight's gradient. Inductor, seeing two independent buffers, computed the region's final add in
place in the sum's buffer while the saved view still had to be read: the last block's first
weight got a wrong gradient, silently (s65; a loss reading the sum as ``(y * y.detach()).sum()``,
which keeps that add materialized). The pass makes the graph read every such view as a view of
the output laid out as the value, so Inductor sees one buffer and its views. Likewise an output
that is one of the call's operands passed through, or a view of one: a checkpointed block's
forward, recomputed in the backward and pruned to what its backward reads, returns a view of its
input (the first linear layer's input); Inductor took the input's buffer for dead after the call
while the view still had to be read (the last block's first weight 0.09 off with ``x.mean()``,
s65). The graph reads such an output as that view of the operand.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import fx

from shardc.passes.body import INVOKE_SUBGRAPH, node_value
from shardc.passes.body_sizes import SizeBuilder
from shardc.passes.fx_utils import call, is_call, is_view, static_layout
from shardc.passes.saved_order import saved_inputs

__all__ = ["derived_saved_values", "read_body_views_through_their_base",
           "save_one_view_per_storage", "view_path"]


def view_path(node: fx.Node, symbolic: bool = False) -> tuple[fx.Node, list[fx.Node]]:
    """``(base, views)``: the node ``node`` is a chain of single-input aten views of, and those
    views from the base's side to ``node`` (empty if ``node`` is no view). ``symbolic``: a view
    may also read size nodes (``view(x, [2*s0, d])`` under dynamic shapes), its input being the
    one tensor among its inputs."""
    views = []
    while isinstance(node, fx.Node) and is_view(node):
        inputs = node.all_input_nodes
        if symbolic:
            inputs = [i for i in inputs if not isinstance(node_value(i), torch.SymInt)]
        if len(inputs) != 1 or inputs[0] is not node.args[0]:
            break
        views.append(node)
        node = inputs[0]
    return node, views[::-1]


def _layout(node: fx.Node) -> tuple | None:
    val = node.meta.get("val")
    return static_layout(val)


def _replayable(views: Sequence[fx.Node], sizes: SizeBuilder | None = None) -> bool:
    """Whether each view's arguments other than its input are constants, or (``sizes``)
    symbolic sizes that ``sizes`` computes in the graph the views are replayed in."""
    for view in views:
        found: list[fx.Node] = []
        fx.node.map_arg((view.args[1:], view.kwargs), found.append)
        if any(sizes is None or not sizes.can_build(node_value(n)) for n in found):
            return False
    return True


def _symbolic_layout(value: object) -> tuple | None:
    """:func:`static_layout` with symbolic sizes too, each as its expression: compared as
    expressions, never evaluated (that would add guards after the trace); two layouts whose
    expressions differ in form but not in value compare unequal, which only leaves a view
    alone."""
    if not isinstance(value, torch.Tensor):
        return None
    items = []
    for i in (*value.shape, *value.stride(), value.storage_offset()):
        if isinstance(i, torch.SymInt):
            items.append(i.node.expr)
        elif type(i) is int:
            items.append(i)
        else:
            return None
    rank = value.dim()
    return (tuple(items[:rank]), tuple(items[rank:2 * rank]), items[-1], value.dtype,
            value.device)


def _any_layout(node: fx.Node) -> tuple | None:
    return _symbolic_layout(node.meta.get("val"))


def _origin(node: fx.Node, fw: fx.GraphModule, bodies: dict
            ) -> tuple[object, list, tuple | None, tuple | None]:
    """``(base key, views from the base to node, the base's layout, node's layout)`` for a
    saved value of ``fw``: the forward node it is a chain of views of, or, where that node is an
    output of a body call, the body value that output is a chain of views of (keyed by call and
    value), with the body's views first. ``bodies`` memoizes each body's outputs."""
    base, views = view_path(node)
    if is_call(base, operator.getitem) and isinstance(base.args[0], fx.Node) \
            and is_call(base.args[0], INVOKE_SUBGRAPH):
        call, position = base.args
        target = call.args[0].target
        if target not in bodies:
            body = getattr(fw, target)
            bodies[target] = next(iter(body.graph.find_nodes(op="output"))).args[0]
        value = bodies[target][position]
        if isinstance(value, fx.Node):
            inner, inner_views = view_path(value)
            own = _layout(node) if views else _layout(value)  # (the body's value, described)
            return (call, inner), inner_views + views, _layout(inner), own
    return base, views, _layout(base), _layout(node)


def _merges(fw: fx.GraphModule, saved: Sequence[fx.Node]) -> dict[int, tuple[int, list]]:
    """``{dropped index: (kept index, views from the base)}`` among ``saved`` (module
    docstring), in the order of ``saved``."""
    bodies: dict = {}
    groups: dict[object, list[tuple[int, list[fx.Node], tuple | None, tuple | None]]] = {}
    for i, node in enumerate(saved):
        if isinstance(node, fx.Node):
            key, views, base_layout, own = _origin(node, fw, bodies)
            groups.setdefault(key, []).append((i, views, base_layout, own))
    merges = {}
    for members in groups.values():
        if len(members) < 2 or members[0][2] is None:
            continue
        kept = next((i for i, _, base_layout, own in members if own == base_layout), None)
        if kept is None:
            continue
        for i, views, _, _ in members:
            if i != kept and _replayable(views):
                merges[i] = (kept, views)
    return merges


def derived_saved_values(gm: fx.GraphModule, saved: Sequence[fx.Node]) -> set[fx.Node]:
    """The values among ``saved`` (of ``gm``, a joint or forward graph) that
    :func:`save_one_view_per_storage` will derive in the backward from another of them rather
    than save: what the budget planner must neither count as memory of their own nor offer to
    offload or recompute (``shardc.passes.recompute``)."""
    return {saved[i] for i in _merges(gm, saved)}


def _replay(bw: fx.GraphModule, kept: fx.Node, views: Sequence[fx.Node],
            dropped: fx.Node, position) -> fx.Node | None:
    """``views`` applied to ``kept`` in ``bw`` before ``dropped``'s first user, with fake
    values; None (nothing left inserted) unless the result is laid out as ``dropped``."""
    node, inserted = kept, []
    with bw.graph.inserting_before(min(dropped.users, key=position)):
        for view in views:
            node = call(bw.graph, view.target, (node, *view.args[1:]), dict(view.kwargs))
            inserted.append(node)
    layout = _layout(node)
    if layout is None or layout != _layout(dropped):
        for n in reversed(inserted):
            bw.graph.erase_node(n)
        return None
    return node


def _position_in(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def save_one_view_per_storage(fw: fx.GraphModule, bw: fx.GraphModule,
                              num_fwd_outputs: int) -> int:
    """Drop from the saved values every value another saved value can be viewed into (module
    docstring); returns how many were dropped. ``fw``'s outputs after its first
    ``num_fwd_outputs`` pair up with ``bw``'s saved inputs, in order (the partitioner's
    convention); graphs where they do not are left as they are. Deterministic: the graphs alone
    decide."""
    output = next(iter(fw.graph.find_nodes(op="output")))
    outs = list(output.args[0])
    saved_out, saved_in = outs[num_fwd_outputs:], saved_inputs(bw)
    if len(saved_out) != len(saved_in) or not saved_in:
        return 0
    merges = _merges(fw, saved_out)
    if not merges:
        return 0
    position = _position_in(bw.graph)  # (of the nodes before any is inserted: all it is asked)
    dropped: list[int] = []
    for i, (k, views) in sorted(merges.items()):
        ph, kept_ph = saved_in[i], saved_in[k]
        if not ph.users:
            continue
        derived = _replay(bw, kept_ph, views, ph, position)
        if derived is None:
            continue
        derived.meta.update({m: v for m, v in ph.meta.items() if m != "val"})
        ph.replace_all_uses_with(derived)
        dropped.append(i)
    if not dropped:
        return 0
    gone = set(dropped)
    for i in sorted(gone):
        bw.graph.erase_node(saved_in[i])
    kept_outs = [n for i, n in enumerate(saved_out) if i not in gone]
    output.args = (tuple(outs[:num_fwd_outputs] + kept_outs),) + tuple(output.args[1:])
    descs = output.meta.get("desc")
    if isinstance(descs, (list, tuple)) and len(descs) == len(outs):
        output.meta["desc"] = list(descs[:num_fwd_outputs]) + [
            d for i, d in enumerate(descs[num_fwd_outputs:]) if i not in gone]
    for i in gone:
        node = saved_out[i]
        if not node.users:
            fw.graph.erase_node(node)
    fw.recompile()
    bw.recompile()
    return len(gone)


def read_body_views_through_their_base(gm: fx.GraphModule) -> int:
    """In ``gm`` (a partitioned forward or backward), read each output of a body call that is a
    chain of views of a body value another output of the same call returns as it is (same
    layout), as those views applied to that output; and each output that is an operand of the
    call passed through, or a chain of views of one, as those views applied to the operand
    (module docstring). Returns how many outputs were rewritten. An output laid out as the
    value moves to right after the call and the views follow it; a view's symbolic sizes (a
    dynamic-shape trace's ``view(x, [2*s0, d])``) are computed from this graph's own size
    symbols (:class:`~shardc.passes.body_sizes.SizeBuilder`), layouts compared as expressions.
    Left as they are: groups without such an output, views whose sizes this graph cannot build,
    and the same body node at two positions (``shardc.passes.repeated_body_outputs``).
    Deterministic: the graph alone decides."""
    bodies: dict[str, tuple[Sequence, list[fx.Node]]] = {}
    changed = 0
    sizes = SizeBuilder(gm)
    for call_node in [n for n in gm.graph.nodes if is_call(n, INVOKE_SUBGRAPH)]:
        target = call_node.args[0].target
        if target not in bodies:
            body = getattr(gm, target)
            bodies[target] = (next(iter(body.graph.find_nodes(op="output"))).args[0],
                              list(body.graph.find_nodes(op="placeholder")))
        outputs, placeholders = bodies[target]
        changed += _read_views_of_call(gm.graph, call_node, outputs, placeholders, sizes)
    if changed:
        gm.recompile()
    return changed


def _read_views_of_call(graph: fx.Graph, call_node: fx.Node, outputs: Sequence,
                        placeholders: list[fx.Node], sizes: SizeBuilder) -> int:
    """:func:`read_body_views_through_their_base` for one call, whose body returns ``outputs``
    and takes ``placeholders``."""
    groups: dict[fx.Node, list[tuple[fx.Node, list[fx.Node]]]] = {}
    for item in list(call_node.users):
        if not is_call(item, operator.getitem) or not isinstance(outputs[item.args[1]], fx.Node):
            continue
        inner, views = view_path(outputs[item.args[1]], symbolic=True)
        groups.setdefault(inner, []).append((item, views))
    operands = list(call_node.args[2:])
    position = {p: i for i, p in enumerate(placeholders)} \
        if len(placeholders) == len(operands) else {}
    changed = 0
    for inner, members in groups.items():
        layout = _any_layout(inner)
        if inner in position and isinstance(operands[position[inner]], fx.Node):
            # An operand passed through (viewed or not): the caller holds it already.
            base, anchor = operands[position[inner]], call_node
            if layout is None or _any_layout(base) != layout:
                continue
            derived = [(item, views) for item, views in members if _replayable(views, sizes)]
        else:
            base = next((item for item, views in members
                         if not views and layout is not None and _any_layout(item) == layout),
                        None)
            derived = [(item, views) for item, views in members
                       if item is not base and views and _replayable(views, sizes)]
            if base is None or not derived:
                continue
            call_node.append(base)  # (a getitem of the call: valid anywhere after it)
            anchor = base
        for item, views in derived:
            node = _replay_after(graph, anchor, base, views, _any_layout(item), sizes)
            if node is None:
                continue
            if node is not base:
                node.meta.update({k: v for k, v in item.meta.items() if k != "val"})
                anchor = node
            item.replace_all_uses_with(node)
            graph.erase_node(item)
            changed += 1
    return changed


def _replay_after(graph: fx.Graph, anchor: fx.Node, base: fx.Node, views: Sequence[fx.Node],
                  layout: tuple | None, sizes: SizeBuilder) -> fx.Node | None:
    """``views`` applied to ``base`` right after ``anchor`` (``base`` itself for none), their
    symbolic sizes computed by ``sizes`` from this graph's own symbols (a body's size nodes are
    not this graph's); None, with nothing left inserted, unless the result is laid out as
    ``layout``."""
    node, stop = base, anchor.next
    with graph.inserting_before(stop):  # (in order, unlike inserting_after)
        for view in views:
            args = fx.node.map_arg(view.args[1:], lambda n: sizes.build(node_value(n)))
            kwargs = fx.node.map_arg(dict(view.kwargs), lambda n: sizes.build(node_value(n)))
            node = call(graph, view.target, (node, *args), kwargs)
    if layout is None or _any_layout(node) != layout:
        while anchor.next is not stop:  # the views and their sizes, all inserted here
            graph.erase_node(stop.prev)
        return None
    return node
