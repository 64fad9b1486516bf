"""Sizes a block body returns, computed by its caller instead: in Dynamo's graph, before the body
calls are described, and again in the partitioned graphs that Inductor compiles (AOTAutograd's
trace maps a size to the node that produced its expression first, a body call's output again).

Dynamo lets a ``nested_compile_region`` subgraph have side effects (every shardc body has: it
swaps its skeleton's parameters) and so returns from it the intermediates its caller might read;
its last pass over the region's graph (``insert_deferred_runtime_asserts``) then hash-conses
symbolic sizes by their expression, region-wide: a size the outer graph computes after a body
call (an inline block's ``x.reshape(-1, d).size(0)``, ``2*s27``) is replaced by the call's output
of the same expression, which then stays an output of the body. Under Inductor a size that an
``invoke_subgraph`` call returns is a ``ShapeAsConstantBuffer``, which its ``view`` lowering
cannot take as a size (``SympifyError``; transformers' GPT-OSS at the dynamic-shape recompile,
where layer 1, inline, views the MoE's output by the token count that layers 0 and 2's body
computed: s72). The FX path and plain ``torch.compile`` (no bodies) are exact.

:func:`recompute_returned_sizes` gives each reader of such an output a copy of the body's own
computation of that size in the outer graph, each body placeholder read as the call's operand
(Dynamo computes sizes in a subgraph from its size symbols and its placeholders' ``size()``: the
symbols are the call's ``SymInt`` operands, the placeholders its tensors). A size the body
computes from an intermediate tensor's size (``x.reshape(-1, d).size(0)``: llama4_text's router
on torch 2.11, ``full_like(router_logits)`` in the inline layer) is built instead from its
symbolic expression (``2*s27``) over the caller's own ``SymInt`` placeholders, which Dynamo lifts
for every size symbol its graph uses. The body still returns the size, unread by the caller (a
body's outputs are one schema for every call of its identifier). A size neither way reaches (a
data-dependent one, a symbol the caller has no placeholder for, an operation other than integer
arithmetic) is left read from the body, and logged.
"""

from __future__ import annotations

import functools
import logging
import operator

import sympy
import torch
from torch import fx

from shardc.passes.body import INVOKE_SUBGRAPH, node_value
from shardc.passes.fx_utils import copy_node, is_call, subgraph_module

__all__ = ["SizeBuilder", "recompute_returned_sizes"]

log = logging.getLogger("shardc")

_SIZE_TYPES = (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)
# Tensor methods that read a size (Dynamo's graph records ``x.size()`` as a ``call_method``).
_SIZE_METHODS = frozenset({"size", "stride", "numel", "dim", "storage_offset"})
# The aten forms, in a graph traced further.
_SIZE_OPS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                       torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default})


def _is_size(value: object) -> bool:
    """A size, or a ``torch.Size``/tuple of sizes (``x.size()``)."""
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _SIZE_TYPES) for v in value)
    return isinstance(value, _SIZE_TYPES)


def _is_size_op(node: fx.Node) -> bool:
    """Arithmetic on sizes (``operator``'s functions, ``torch.sym_*``) or a read of a tensor's
    size, whose value is a size: nothing that depends on a tensor's data."""
    if not _is_size(node_value(node)) or node.meta.get("unbacked_bindings"):
        return False
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if target in _SIZE_OPS:
        return True
    module = getattr(target, "__module__", None)
    name = getattr(target, "__name__", "")
    return module in ("_operator", "operator", "math") or (
        module is not None and module.startswith("torch") and name.startswith("sym_"))


class _Uncopyable(Exception):
    pass


def _copy_size(graph: fx.Graph, node: fx.Node, env: dict[fx.Node, object]) -> object:
    """``node`` of a body computed in ``graph`` (the caller's), placeholders mapped by ``env``
    (and the copies made so far); raises :class:`_Uncopyable` for a node that is not size
    arithmetic on the body's placeholders."""
    if node in env:
        return env[node]
    if node.op == "placeholder" or not _is_size_op(node):
        raise _Uncopyable(node)
    for arg in node.all_input_nodes:
        _copy_size(graph, arg, env)
    env[node] = copied = copy_node(graph, node, env.__getitem__)
    return copied


# Integer operations of a size expression (torch's sympy functions, by name: their module is
# private) and the Python operator each is computed with.
_EXPR_OPS = {"FloorDiv": operator.floordiv, "PythonMod": operator.mod, "Mod": operator.mod}


def _symbol_sources(gm: fx.GraphModule) -> dict[sympy.Symbol, fx.Node]:
    """Each size symbol of ``gm`` by the ``SymInt`` placeholder that carries it."""
    sources: dict[sympy.Symbol, fx.Node] = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node_value(node)
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            sources.setdefault(value.node.expr, node)
    return sources


def _emit(graph: fx.Graph, op, args: list) -> fx.Node:
    node = graph.call_function(op, tuple(args))
    value = op(*(node_value(a) for a in args))
    # Dynamo's graph records "example_value", AOTAutograd's "val": both, for either graph.
    node.meta["example_value"] = node.meta["val"] = value
    return node


def _expr_op(expr: sympy.Expr, sources: dict[sympy.Symbol, fx.Node]):
    """How ``expr``'s node is computed: ``None`` for a leaf (an integer, a symbol of
    ``sources``), else the operator that folds its arguments; raises :class:`_Uncopyable` for a
    symbol without a placeholder or an operation that is not integer arithmetic."""
    if expr.is_Integer:
        return None
    if expr.is_Symbol:
        if expr not in sources:
            raise _Uncopyable(expr)
        return None
    if isinstance(expr, sympy.Add):
        return operator.add
    if isinstance(expr, sympy.Mul):
        return operator.mul
    op = _EXPR_OPS.get(type(expr).__name__)
    if op is None or len(expr.args) != 2:
        raise _Uncopyable(expr)
    return op


def _check_expr(expr: sympy.Expr, sources: dict[sympy.Symbol, fx.Node]) -> None:
    _expr_op(expr, sources)
    for arg in expr.args:
        _check_expr(arg, sources)


def _build_expr(graph: fx.Graph, expr: sympy.Expr, sources: dict[sympy.Symbol, fx.Node]
                ) -> object:
    """``expr`` (a size's symbolic expression, :func:`_check_expr`'d) computed in ``graph``
    from the placeholders of ``sources``."""
    op = _expr_op(expr, sources)
    if op is None:
        return int(expr) if expr.is_Integer else sources[expr]
    args = [_build_expr(graph, a, sources) for a in expr.args]
    return functools.reduce(lambda a, b: _emit(graph, op, [a, b]), args)


class SizeBuilder:
    """Sizes computed in ``gm`` from its own ``SymInt`` placeholders (the symbols Dynamo and
    AOTAutograd lift as graph inputs): for a size a body call returns, or a view's size that a
    caller replays (``shardc.passes.aliased_saved_values``)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.graph = gm.graph
        self.sources = _symbol_sources(gm)

    def can_build(self, value: object) -> bool:
        if isinstance(value, int) and not isinstance(value, bool):
            return True
        if not isinstance(value, torch.SymInt):
            return False
        try:
            _check_expr(value.node.expr, self.sources)
        except _Uncopyable:
            return False
        return True

    def build(self, value: object) -> object:
        """``value`` computed at the graph's insertion point (an int as it is); raises
        :class:`_Uncopyable` where :meth:`can_build` is False, before inserting anything."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if not self.can_build(value):
            raise _Uncopyable(value)
        return _build_expr(self.graph, value.node.expr, self.sources)


def _size_in_caller(graph: fx.Graph, computed: fx.Node, env: dict[fx.Node, object],
                    value: object, sizes: SizeBuilder) -> object | None:
    """The size ``value`` that a body computes as ``computed``, in the caller's ``graph`` at its
    insertion point: a copy of the body's arithmetic on the call's operands, else (a symbolic
    size) built from the caller's size symbols; None where neither reaches it."""
    try:
        return _copy_size(graph, computed, env)
    except _Uncopyable:
        pass
    if isinstance(value, torch.SymInt) and sizes.can_build(value):
        return sizes.build(value)
    return None


def recompute_returned_sizes(root: fx.GraphModule) -> int:
    """Give every reader of a size that an ``invoke_subgraph`` call of ``root`` (or of a
    subgraph of it) returns the size computed in the reader's own graph; returns how many
    outputs' readers were rewired (see the module's docstring)."""
    rewired = 0
    for gm in list(root.modules()):
        if not isinstance(gm, fx.GraphModule):
            continue
        changed = False
        sizes = SizeBuilder(gm)
        for call in list(gm.graph.nodes):
            if not is_call(call, INVOKE_SUBGRAPH):
                continue
            body = subgraph_module(call)
            if body is None:
                continue
            outputs = body.graph.output_node().args[0]
            placeholders = body.graph.find_nodes(op="placeholder")
            operands = dict(zip(placeholders, call.args[2:]))
            env: dict[fx.Node, object] = dict(operands)
            for item in list(call.users):
                if not (is_call(item, operator.getitem) and item.users
                        and isinstance(node_value(item), _SIZE_TYPES)
                        and isinstance(outputs[item.args[1]], fx.Node)):
                    continue
                # Before the call: a copy reads only the call's operands and placeholders.
                with gm.graph.inserting_before(call):
                    size = _size_in_caller(gm.graph, outputs[item.args[1]], env,
                                           node_value(item), sizes)
                if size is None:
                    log.debug("shardc: the size %s that body %s returns stays read from it",
                              node_value(item), call.args[1])
                    continue
                item.replace_all_uses_with(size)
                gm.graph.erase_node(item)
                rewired += 1
                changed = True
            for node in reversed([c for n, c in env.items() if n not in operands]):
                if not node.users:  # (what a size left read from the body had copied)
                    gm.graph.erase_node(node)
        if changed:
            gm.recompile()
    return rewired
