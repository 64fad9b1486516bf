"""Small FX helpers shared by the passes and planners: creating nodes with fake values, views,
walking users."""

from __future__ import annotations

import operator
import re
import weakref
from typing import Any

import torch
from torch import fx

from shardc import _torch

# A memo of a pure function of the graph (its placeholders' fake mode), not state: dropped with
# the graph, and recomputing it gives the same answer.
_FAKE_MODE_MEMO: weakref.WeakKeyDictionary[fx.Graph, object] = weakref.WeakKeyDictionary()


def fake_mode_of(graph: fx.Graph):
    # Looked up once per graph: passes insert thousands of nodes into large graphs.
    if graph not in _FAKE_MODE_MEMO:
        vals = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        _FAKE_MODE_MEMO[graph] = _torch.detect_fake_mode(
            [v for v in vals if isinstance(v, torch.Tensor)])
    return _FAKE_MODE_MEMO[graph]


def call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` at the graph's insertion point, with ``meta['val']``.

    The fake value is computed from the arguments' fake values, so later passes (and Inductor)
    see shapes and dtypes on every node shardc inserts.
    """
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    mode = fake_mode_of(graph)
    if mode is not None:
        fake_args = _fake_values(args)
        fake_kwargs = _fake_values(kwargs)
        with mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    return node


# A node name's numbered suffix (``mm_3``).
_NUMBERED = re.compile(r"_\d+$")


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """``graph.node_copy(node, arg_transform)``, named from the name's base (``mm`` for
    ``mm_3``). For copies whose names are taken many times over (a body inlined once per
    block): fx in torch 2.11/2.12 resolves a taken numbered name by trying ``mm_1``, ``mm_2``,
    ... in turn, quadratic in the number of copies, while a base name continues from the last
    number given (torch 2.13's fx looks up the base either way). The copy's arguments are not
    checked again for raw symbolic values (:func:`shardc._torch.create_node_unchecked`): they
    are the node's own, mapped to other nodes."""
    kwargs = fx.map_arg(node.kwargs, arg_transform) if node.kwargs else None  # (most have none)
    copied = _torch.create_node_unchecked(
        graph, node.op, node.target, fx.map_arg(node.args, arg_transform), kwargs,
        _NUMBERED.sub("", node.name) or node.name, node.type)
    copied.meta.update(node.meta)  # a new node's own empty dict: no fx __setattr__ path
    return copied


def _node_val(a: Any):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


# Argument types whose values are passed as they are (no node can be inside them).
_PLAIN_ARGS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
               torch.memory_format)


def static_layout(value: object) -> tuple | None:
    """``(sizes, strides, storage offset, dtype, device)`` of a tensor whose sizes, strides and
    offset are plain ints, else None (comparing symbolic ones would add guards after the
    trace)."""
    if not isinstance(value, torch.Tensor):
        return None
    ints = (*value.shape, *value.stride(), value.storage_offset())
    if not all(type(i) is int for i in ints):
        return None
    return (tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
            value.device)


def overlapping(layout: tuple | None) -> bool:
    """Whether a :func:`static_layout` maps two elements to one memory location: a stride 0 on
    a dimension longer than one (an ``expand``). Nothing can be copied into such a layout but
    values that repeat as it does."""
    return layout is not None and any(st == 0 and n > 1 for n, st in zip(layout[0], layout[1]))


def recomputed_value(graph: fx.Graph, node: fx.Node) -> object:
    """``node``'s fake value computed again from its inputs' fake values (a ``call_function``
    node of ``graph``), or None where there is no fake mode or torch cannot evaluate it."""
    mode = fake_mode_of(graph)
    if mode is None or node.op != "call_function":
        return None
    try:
        with mode:
            return node.target(*_fake_values(node.args), **_fake_values(dict(node.kwargs)))
    except Exception:  # (an op torch cannot evaluate on these values: the caller keeps its own)
        return None


def _fake_values(a: Any):
    """``a`` with every node replaced by its fake value: what ``tree_map_only(fx.Node, ...)``
    gives, walked directly for the plain tuples, lists, dicts and scalars the passes build
    (the pytree walk cost about as much as creating the node), by pytree for anything else."""
    t = type(a)
    if t is fx.Node:
        return a.meta.get("val")
    if t is tuple:
        return tuple(_fake_values(x) for x in a)
    if t is list:
        return [_fake_values(x) for x in a]
    if t is dict:
        return {k: _fake_values(v) for k, v in a.items()}
    if t in _PLAIN_ARGS:
        return a
    return _torch.tree_map_only(fx.Node, _node_val, a)


# Stand-in for a data-dependent (unbacked) size, e.g. the tokens routed to one expert: estimates
# only (cost model, memory prediction), never a decision every rank must agree on.
UNBACKED_SIZE_HINT = 8192


def _hint_fn():
    """torch's guard-free size hint, ``f(symint, fallback=...)``: ``optimization_hint`` where
    torch has it (2.12+), else ``size_hint`` (2.11, whose ``hint_int`` warns that it is
    deprecated at every call), else ``hint_int``. The one place shardc reaches for them."""
    from torch.fx.experimental import symbolic_shapes

    for name in ("optimization_hint", "size_hint"):
        fn = getattr(symbolic_shapes, name, None)
        if fn is not None:
            return fn
    return symbolic_shapes.hint_int


def size_hint(value: int | torch.SymInt) -> int:
    """An int for a size that may be symbolic, without adding a guard: the size the graph was
    traced with for a dynamic size, :data:`UNBACKED_SIZE_HINT` for a data-dependent one.

    ``int(symint)`` would specialize the compiled graph to that size (a recompile for every new
    batch size) or raise ``GuardOnDataDependentSymNode``; planning only estimates with sizes.
    """
    if isinstance(value, torch.SymInt):
        return int(_hint_fn()(value, fallback=UNBACKED_SIZE_HINT))
    return int(value)


def dtype_itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def tensor_nbytes(value) -> int:
    """Bytes of a tensor value (or a list/tuple of them: the sum) by its size hints, so that
    counting adds no guard; 0 for anything else."""
    if isinstance(value, torch.Tensor):
        numel = 1
        for s in value.shape:
            numel *= size_hint(s)
        return numel * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_nbytes(v) for v in value)
    return 0


def lazy_graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A graph module of ``graph`` (attributes from ``root``) that generates its Python code
    only when first called: planning builds graphs of tens of thousands of nodes that it never
    runs. torch's lazy graph module class is private; without it, an ordinary one."""
    lazy = _torch.lazy_graph_module_class()
    return fx.GraphModule(root, graph) if lazy is None else lazy(root, graph)


def needed_by(roots) -> set[fx.Node]:
    """The nodes among ``roots`` (anything else in it is ignored) and every node they read,
    transitively."""
    stack = [r for r in roots if isinstance(r, fx.Node)]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with new nodes (sharing their meta values), for passes to change freely."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return lazy_graph_module(gm, graph)


def op_overload(node: fx.Node) -> _torch.OpOverload | None:
    """The op overload ``node`` calls, if it calls one."""
    target = node.target
    return target if node.op == "call_function" and isinstance(target, _torch.OpOverload) else None


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` calls an aten view op (its output aliases its input), or takes one
    element of a multi-output view op's list (``split``, ``unbind``: each element aliases the
    op's input; a packed block's unpack splits its gathered buffer)."""
    op = op_overload(node)
    if op is not None:
        return op.is_view
    if node.op == "call_function" and node.target is operator.getitem \
            and isinstance(node.args[0], fx.Node):
        source = op_overload(node.args[0])
        return source is not None and source.is_view
    return False


CASTS = frozenset({torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default})


def is_view_or_cast(node: fx.Node) -> bool:
    return is_view(node) or op_overload(node) in CASTS


def has_tag(node: fx.Node, tag: torch.Tag) -> bool:
    op = op_overload(node)
    return op is not None and tag in op.tags


def view_chain(node: fx.Node) -> list[fx.Node] | None:
    """The views from ``node`` back to the graph input it is a chain of single-input views of
    (``node`` first, the input excluded; empty if ``node`` is the input), or None if it is not
    such a chain."""
    chain = []
    while node.op != "placeholder":
        if not (is_view(node) and len(node.all_input_nodes) == 1):
            return None
        chain.append(node)
        node = node.all_input_nodes[0]
    return chain


def view_chain_root(node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` is a chain of single-input views of, if it is one."""
    chain = view_chain(node)
    if chain is None:
        return None
    return chain[-1].all_input_nodes[0] if chain else node


def view_users(node: fx.Node) -> tuple[list[fx.Node], list[fx.Node]]:
    """(views taken of ``node``, transitively; the other nodes that read any of them)."""
    views, readers, stack = [], [], [node]
    while stack:
        for user in stack.pop().users:
            if is_view(user):
                if user not in views:
                    views.append(user)
                    stack.append(user)
            elif user not in readers:
                readers.append(user)
    return views, readers


def gather_derived(gather: fx.Node) -> list[fx.Node]:
    """``gather`` and every node reachable from it through views and casts only."""
    seen, stack = [gather], [gather]
    while stack:
        for user in stack.pop().users:
            if is_view_or_cast(user) and user not in seen:
                seen.append(user)
                stack.append(user)
    return seen


# The activation-checkpoint region id of values shardc tags for recomputation outside any user
# checkpoint region. torch's partitioner saves a recomputed value whose reader is recomputed in a
# region of a *higher* id (the boundary between two checkpointed regions): with the highest id,
# a re-gathered weight read by a checkpointed region (a block body's, or one inlined from it) is
# still recomputed, not saved.
OUTSIDE_CHECKPOINT_ID = 1 << 30


def recompute_tag(node: fx.Node, policy) -> None:
    """Tag ``node`` for the partitioner (``CheckpointPolicy``: must save, must recompute); a
    node in no checkpoint region gets :data:`OUTSIDE_CHECKPOINT_ID`."""
    node.meta["recompute"] = policy
    node.meta.setdefault("ac_graph_id", OUTSIDE_CHECKPOINT_ID)


def subgraph_module(call: fx.Node) -> fx.GraphModule | None:
    """The graph module a ``call`` of a compiled-once block body (``invoke_subgraph``) runs: its
    first argument, a ``get_attr`` of the graph's owning module; None where it is no such call
    or cannot be resolved (a graph without an owning module)."""
    if call.op != "call_function" or call.target is not torch.ops.higher_order.invoke_subgraph:
        return None
    attr = call.args[0] if call.args else None
    owner = call.graph.owning_module
    if not isinstance(attr, fx.Node) or attr.op != "get_attr" or owner is None:
        return None
    body = getattr(owner, str(attr.target), None)
    return body if isinstance(body, fx.GraphModule) else None


def is_call(node: fx.Node, target) -> bool:
    return node.op == "call_function" and node.target is target


def allocate_real(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A real (not fake) uninitialized tensor, even while a compiler's fake mode is active
    (passes run inside AOTAutograd's tracing context)."""
    with _torch.unset_fake_temporarily():
        return torch.empty(size, dtype=dtype, device=device)


def tensors_in(value: object) -> list[torch.Tensor]:
    """The tensors of a node's value: the value itself, or those of a list/tuple of outputs."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]
