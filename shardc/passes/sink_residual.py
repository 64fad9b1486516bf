"""Sink each compile-once block body's final residual add into the next body call
(``sink_block_residual``; Dynamo's graph, after the body calls are described, before AOTAutograd).

Inductor cannot fuse across a body's boundary: the add that ends a pre-norm residual block,
``h_out = h_mid + mlp_out``, is a kernel of its own between two body calls, where with the blocks
inline Inductor fuses it into the next block's norm (one kernel writing both; docs/overhead.md,
"The compile-once body boundary"). This pass moves that add across the boundary:

* the body whose one output is ``add(a, b)`` becomes a body (a copy, registered beside it) that
  takes the pair ``(a_prev, b_prev)`` in place of its hidden-state input ``h``, computes
  ``h = a_prev + b_prev`` first (the same add, so the same bits; Inductor fuses it into the
  norm that reads ``h``) and returns ``(a, b)``;
* call ``i + 1`` takes call ``i``'s pair; the first call takes ``(h0, zeros_like(h0))``
  (``h0 + 0`` is ``h0`` for every finite value: one compiled body for every block); after the
  last call the outer graph computes ``a + b`` itself (Inductor fuses it into what reads it,
  e.g. the final norm).

It applies to a body only where every call of it is in the region's top-level graph, the calls
form one chain (each call's output read only by the next call, as its hidden-state input at the
same position), and the body's output is one add of two tensors with the output's own shape,
strides, dtype and device; otherwise the calls stay as they are, with the reason
(:func:`sink_block_residuals` returns it; the backend logs it once and puts it in the plan's
notes).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from shardc.passes.body import BodyCall, body_calls, unique_attr
from shardc.passes.fx_utils import is_call

__all__ = ["SinkEdits", "SinkOutcome", "SunkBodiesRecomputed", "sink_block_residuals",
           "tie_pair_tangents", "unsink"]

# The traced forms of ``x + y`` (Dynamo: ``operator.add``; ``torch.add`` / ``Tensor.add``
# without ``alpha``; an aten graph's ``add.Tensor``).
_ADD_FUNCTIONS = (operator.add, torch.add, torch.ops.aten.add.Tensor)


@dataclass(frozen=True)
class SinkOutcome:
    """What :func:`sink_block_residuals` did for one body (``identifier``)."""

    identifier: str
    block_type: str
    calls: int
    reason: str = ""  # why its calls were left as they were ("": sunk)
    edits: SinkEdits | None = field(default=None, compare=False)  # to undo it (:func:`unsink`)

    def note(self) -> str:
        if self.reason:
            return (f"sink_block_residual: block body {self.identifier} ({self.block_type}) "
                    f"keeps its residual add: {self.reason}")
        return (f"sink_block_residual: block body {self.identifier} ({self.block_type}): its "
                f"final residual add is computed by the next of its {self.calls} calls (the "
                "first takes the hidden state and zeros; the outer graph adds the last pair)")


class SunkBodiesRecomputed(RuntimeError):
    """The peak budget's planner recomputes blocks whose bodies are sunk (``blocks``): each
    would save its call's pair as its checkpoint, twice what the block as traced saves. With
    ``sink_block_residual="auto"`` the backend compiles the region again without sinking."""

    def __init__(self, blocks: list[str]) -> None:
        super().__init__(f"sunk block bodies recomputed: {', '.join(blocks)}")
        self.blocks = blocks


@dataclass
class SinkEdits:
    """What sinking one body changed in the region's graph, to put it back (:func:`unsink`)."""

    attr: str  # the sunk body's attribute on the root module
    getters: list[tuple[fx.Node, str]] = field(default_factory=list)  # (get_attr, old target)
    calls: list[tuple[fx.Node, tuple, object]] = field(default_factory=list)  # old args, value
    outputs: list[tuple[fx.Node, object]] = field(default_factory=list)  # getitem 0, old value
    added: list[fx.Node] = field(default_factory=list)  # in the order they were inserted
    zeros: fx.Node | None = None  # the first call's zeros (the pair's half it is given)
    total: fx.Node | None = None  # the outer graph's add of the last pair
    last: fx.Node | None = None  # what ``total`` replaced: the last call's output


def unsink(root: fx.GraphModule, edits: list[SinkEdits]) -> None:
    """Put back what :func:`sink_block_residuals` changed (each body's calls as they were
    traced, its final add inside it again). Body stand-ins made after it must be undone first
    (``shardc.passes.body_standin.undo_stand_ins``)."""
    graph = root.graph
    for edit in edits:
        edit.total.replace_all_uses_with(edit.last)
        for node, args, value in edit.calls:
            node.args = args
            node.meta["example_value"] = value
        for node, value in edit.outputs:
            node.meta["example_value"] = value
        for node in (edit.total, *reversed(edit.added)):
            graph.erase_node(node)
        for getter, target in edit.getters:
            getter.target = target
        delattr(root, edit.attr)
    if edits:
        graph.lint()
        root.recompile()


def _value(node: object) -> object:
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def _layout(value: object) -> tuple | None:
    if not isinstance(value, torch.Tensor):
        return None
    # Symbolic sizes compared by name: comparing them as symbols would add guards.
    def sizes(xs) -> tuple:
        return tuple(x if isinstance(x, int) else str(x) for x in xs)

    return (sizes(value.shape), sizes(value.stride()), value.dtype, value.device)


def _residual_add(body: fx.GraphModule) -> tuple[fx.Node | None, str]:
    """The body's one output if it is ``add(a, b)`` of two tensors of its own layout (and read
    by nothing else), else None and why not."""
    (out,) = body.graph.find_nodes(op="output")
    results = out.args[0]
    if not isinstance(results, (tuple, list)) or len(results) != 1:
        count = len(results) if isinstance(results, (tuple, list)) else "a non-tuple of"
        return None, f"its body returns {count} values, not one hidden state"
    add = results[0]
    is_add = isinstance(add, fx.Node) and not add.kwargs and len(add.args) == 2 and (
        (add.op == "call_function" and add.target in _ADD_FUNCTIONS)
        or (add.op == "call_method" and add.target == "add"))
    if not is_add or not all(isinstance(a, fx.Node) for a in add.args):
        return None, "its body's output is not a residual add of two tensors (x + y)"
    if list(add.users) != [out]:
        return None, "its body reads the residual add's result itself"
    layout = _layout(_value(add))
    if layout is None or any(_layout(_value(a)) != layout for a in add.args):
        return None, ("the residual add's operands differ from its result in shape, strides, "
                      "dtype or device")
    return add, ""


def _chain(calls: list[fx.Node]) -> tuple[int | None, str]:
    """The operand position (among the body's operands) at which each call reads the previous
    call's output, if the calls form one chain; else None and why not."""
    if len(calls) < 2:
        return None, "it is called once (nothing to fuse across)"
    position = None
    for prev, nxt in zip(calls, calls[1:]):
        users = list(prev.users)
        if len(users) != 1 or not is_call(users[0], operator.getitem) or users[0].args[1] != 0:
            return None, f"the output of call {prev.name} is not read as one value"
        out = users[0]
        operands = list(nxt.args[2:])
        if list(out.users) != [nxt] or operands.count(out) != 1:
            return None, (f"the output of call {prev.name} is read by more than the next call's "
                          "hidden-state input")
        p = operands.index(out)
        if position is not None and p != position:
            return None, "the calls take the previous output at different positions"
        position = p
    users = list(calls[-1].users)
    if len(users) != 1 or not is_call(users[0], operator.getitem) or users[0].args[1] != 0:
        return None, f"the output of the last call {calls[-1].name} is not read as one value"
    return position, ""


def sink_block_residuals(root: fx.GraphModule, found: list[tuple[fx.Node, BodyCall]]
                         ) -> list[SinkOutcome]:
    """Sink the final residual add of each body that ``found`` (``describe_body_calls``) calls,
    where the pattern matches (module docstring); returns one outcome per body. The caller
    describes the calls again (their operands moved)."""
    by_body: dict[str, list[tuple[fx.Node, BodyCall]]] = {}
    for node, call in found:
        by_body.setdefault(call.identifier, []).append((node, call))
    outcomes = []
    changed = False
    for identifier, pairs in by_body.items():
        nodes = [node for node, _ in pairs]
        block_type = pairs[0][1].block_type
        reason = _refusal(root, identifier, nodes)
        if not reason:
            add, reason = _residual_add(getattr(root, nodes[0].args[0].target))
        if not reason:
            position, reason = _chain(nodes)
        edits = None
        if not reason:
            reason, edits = _sink(root, nodes, add, position)
            changed = changed or not reason
        outcomes.append(SinkOutcome(identifier, block_type, len(nodes), reason, edits))
    if changed:
        root.graph.lint()
        root.recompile()
    return outcomes


def _refusal(root: fx.GraphModule, identifier: str, nodes: list[fx.Node]) -> str:
    if any(node.graph is not root.graph for node in nodes):
        return ("its calls run inside another higher-order op (e.g. activation checkpointing "
                "around the whole block), not in the region's graph")
    if len({node.args[0].target for node in nodes}) != 1:
        return "its calls run different subgraphs"
    every = [n for m in root.modules() if isinstance(m, fx.GraphModule)
             for n in body_calls(m) if str(n.args[1]) == identifier]
    if len(every) != len(nodes):
        return "the region calls its subgraph from elsewhere too"
    return ""


def _sink(root: fx.GraphModule, calls: list[fx.Node], add: fx.Node, position: int
          ) -> tuple[str, SinkEdits | None]:
    """Rewrite the body and its calls (the pattern matched); returns ("", what it changed) or
    why not after all (nothing changed)."""
    body = getattr(root, calls[0].args[0].target)
    first = calls[0].args[2 + position]
    layout = _layout(_value(add))
    if _layout(_value(first)) != layout:
        return ("the first call's hidden-state input differs from the body's output in shape, "
                "strides, dtype or device"), None
    places = body.graph.find_nodes(op="placeholder")
    if _layout(_value(places[position])) != layout:
        return "the body's hidden-state input differs from its output in layout", None
    a_node, b_node = add.args
    sunk = _sunk_body(body, add, position)
    attr = unique_attr(root, f"{calls[0].args[0].target}_sunk")
    setattr(root, attr, sunk)
    edits = SinkEdits(attr)
    for getter in dict.fromkeys(node.args[0] for node in calls):
        edits.getters.append((getter, getter.target))
        getter.target = attr
    graph = root.graph
    pair = (_value(a_node), _value(b_node))
    previous: tuple[fx.Node, fx.Node] | None = None
    for node in calls:
        operands = list(node.args[2:])
        if previous is None:
            with graph.inserting_before(node):
                zeros = graph.call_function(torch.zeros_like, (first,))
            zeros.meta["example_value"] = torch.zeros_like(_value(first))
            edits.added.append(zeros)
            edits.zeros = zeros
            operands[position:position + 1] = [first, zeros]
        else:
            operands[position:position + 1] = list(previous)
        edits.calls.append((node, node.args, node.meta.get("example_value")))
        node.args = (*node.args[:2], *operands)
        node.meta["example_value"] = pair
        (out,) = node.users
        with graph.inserting_after(out):
            second = graph.call_function(operator.getitem, (node, 1))
        edits.added.append(second)
        edits.outputs.append((out, out.meta.get("example_value")))
        out.meta["example_value"], second.meta["example_value"] = pair
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in out.meta:
                second.meta[key] = out.meta[key]
        previous = (out, second)
    out, second = previous
    # The last call's two outputs get one gradient (the add's) in the backward, where every
    # other call's get two tensors (the next body's): torch traces a second backward body for
    # tangents that alias. A view of one operand keeps the values and gives it its own tensor.
    with graph.inserting_after(second):
        view = graph.call_method("view_as", (second, second))
    view.meta["example_value"] = pair[1]
    edits.added.append(view)
    with graph.inserting_after(view):
        total = graph.node_copy(add, lambda n: out if n is a_node else view)
    total.meta = {k: v for k, v in add.meta.items() if k in ("example_value", "val",
                                                             "stack_trace", "source_fn_stack")}
    if "nn_module_stack" in calls[-1].meta:
        total.meta["nn_module_stack"] = calls[-1].meta["nn_module_stack"]
    out.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
    edits.total, edits.last = total, out
    return "", edits


def _sunk_body(body: fx.GraphModule, add: fx.Node, position: int) -> fx.GraphModule:
    """A copy of ``body`` taking ``(a_prev, b_prev)`` at ``position`` in place of its hidden
    state, computing ``h = add(a_prev, b_prev)`` first and returning ``add``'s operands."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(body.graph, env)
    places = [env[p] for p in body.graph.find_nodes(op="placeholder")]
    hidden = places[position]
    a_node, b_node = add.args
    pair = []
    for node, suffix in ((a_node, "a"), (b_node, "b")):
        with graph.inserting_before(hidden):
            place = graph.placeholder(f"{hidden.target}_sunk_{suffix}")
        place.meta = dict(hidden.meta)
        for key in ("example_value", "val"):
            if key in hidden.meta:
                place.meta[key] = _value(node)
        pair.append(place)
    with graph.inserting_after(places[-1]):
        h = graph.node_copy(add, lambda n: pair[0] if n is a_node else pair[1])
    h.meta = dict(hidden.meta) | {k: v for k, v in add.meta.items() if k != "val"}
    hidden.replace_all_uses_with(h)
    graph.erase_node(hidden)
    # An operand may be the hidden state itself (``x + f(x)``): now the sum computed first.
    graph.output(tuple(h if env[n] is hidden else env[n] for n in (a_node, b_node)))
    graph.erase_node(env[add])
    graph.lint()
    sunk = fx.GraphModule(body, graph, class_name=type(body).__name__)
    if hasattr(body, "meta"):
        sunk.meta = dict(body.meta)
    return sunk


def tie_pair_tangents(joint: fx.GraphModule) -> bool:
    """In a sunk body's joint graph (AOTAutograd's, before its partition): read the gradient of
    its second output from the first's placeholder. Each call's two outputs are read only by
    one add (the next call's first op, or the region's final add), so their gradients are one
    value, and at run time one buffer (the next body's backward returns it twice). Inductor
    compiles a body's backward as the owner of its inputs and may reuse a dead input's buffer
    in place; with two placeholders for one buffer it could overwrite one that is still to be
    read. Returns whether the body had the two tangents."""
    tangents = [p for p in joint.graph.find_nodes(op="placeholder")
                if p.name.startswith("tangents")]
    if len(tangents) != 2:
        return False
    first, second = tangents
    layouts = [_layout(t.meta.get("val")) for t in tangents]
    if layouts[0] is None or layouts[0] != layouts[1]:
        return False
    second.replace_all_uses_with(first)
    joint.recompile()
    return True
