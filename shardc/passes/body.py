"""Passes for block bodies (``shardc.sharding.blocks``): the ``invoke_subgraph`` calls that run
one compiled body per repeated block, with the block's gathered weights as arguments.

* :func:`rewrite_trace_once_calls` (Dynamo's graph, first): the block calls Dynamo did not trace
  (``shardc.ops.body_call``, torch < 2.13) become calls of their first call's subgraph.
* :func:`describe_body_calls` (Dynamo's graph, before AOTAutograd): which calls are shardc's
  bodies, which blocks they run, which of their inputs are gathered weights.
* :func:`inline_body_calls` (Dynamo's graph): turn the bodies back into inline code
  (``compile_blocks_once=False``).
* :func:`flattened` (any graph): a copy with every body call inlined, for analyses that walk a
  step's ops in order (the peak prediction's liveness, the cost model's kernels).
* :func:`tag_weight_recompute` (a body's joint graph): recompute what the body computes from
  its weights alone, so the body saves the weights themselves, never a transpose or cast of them.
* :func:`rewire_saved_inputs` (the outer joint graph): a body output that is one of its inputs
  is read from that input, so a saved weight becomes the gather, which the reshard pass
  recomputes in the backward: every block's weights are freed after its forward again.
* :func:`weight_derived_outputs` (for ``check_no_gathered_saved``): body outputs that are
  weights or computed from weights alone.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from shardc.ops.gather import GATHER_OP, REDUCE_SCATTER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.fx_utils import (
    copy_node,
    is_call,
    is_view_or_cast,
    lazy_graph_module,
    recompute_tag,
    subgraph_module,
)

__all__ = ["BodyCall", "TraceOnceMismatch", "add_body_variant", "body_calls", "call_body_variant",
           "calls_by_marked_body", "describe_body_calls", "draws_random_numbers",
           "drop_body_call", "flattened", "gather_of", "inline_body_calls", "input_signature",
           "is_body_joint", "rewire_saved_inputs", "rewrite_trace_once_calls",
           "tag_weight_recompute", "unique_attr", "weight_derived_outputs"]

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


@dataclass(frozen=True)
class BodyCall:
    """One ``invoke_subgraph`` call of a shardc body in Dynamo's graph."""

    identifier: str
    block: str  # the block's module name, e.g. "layers.3"
    block_type: str
    weights: tuple[int, ...]  # positions of gathered weights among the call's operands
    inputs: tuple[str, ...]  # input_signature of the body's placeholders


def body_calls(gm: fx.GraphModule) -> Iterator[fx.Node]:
    return (n for n in gm.graph.nodes if is_call(n, INVOKE_SUBGRAPH))


def gather_of(node: object) -> fx.Node | None:
    """The shardc gather ``node`` is (directly, or through views and casts: aten's, or in
    Dynamo's graph the tensor's transposing attributes and view methods), or None."""
    while isinstance(node, fx.Node):
        if is_call(node, GATHER_OP):
            return node
        if node.op == "call_function" and is_view_or_cast(node):
            node = node.all_input_nodes[0]
            continue
        node = _dynamo_view_source(node)
    return None


# Tensor attributes and methods that return a view of the tensor, as Dynamo's graph records
# them (``w.T`` is ``getattr(w, "T")``; ``w.t()`` a ``call_method``). Dynamo computes such a view
# of a body's weight outside the body where the block reads it as an attribute of the weight
# (transformers' FalconLinear: ``input @ self.weight.T``), so the body takes the transpose.
_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH"})
_VIEW_METHODS = frozenset({"t", "transpose", "permute", "view", "expand", "unsqueeze",
                           "squeeze", "detach"})


def _dynamo_view_source(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` is a view of, where Dynamo's graph records ``node`` as one of the
    views above, else None."""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr:
        return source if len(node.args) == 2 and node.args[1] in _VIEW_ATTRIBUTES else None
    if node.op == "call_method" and node.target in _VIEW_METHODS:
        return source
    return None


def input_signature(values: list) -> tuple[str, ...]:
    """Shapes and dtypes of a body's inputs (placeholders' fake values), to match a body's joint
    graph to the Dynamo call it came from."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            # Symbolic sizes print with names that differ between Dynamo's and AOTAutograd's
            # graphs: only static sizes are compared.
            shape = tuple(d if isinstance(d, int) else "?" for d in v.shape)
            out.append(f"{shape}:{v.dtype}")
        else:
            out.append(type(v).__name__)
    return tuple(out)


def _placeholder_values(gm: fx.GraphModule) -> list:
    return [p.meta.get("val", p.meta.get("example_value"))
            for p in gm.graph.find_nodes(op="placeholder")]


def describe_body_calls(gm: fx.GraphModule, block_of_param
                        ) -> list[tuple[fx.Node, BodyCall]]:
    """The calls in Dynamo's graph ``gm`` that run shardc bodies: calls some of whose operands
    are shardc gathers of one block (``block_of_param(fqn)`` -> the block's module name and
    type, or None), in graph order: a call inside another higher-order op (the user's
    activation checkpointing) at that op's place. (Listing those after the root graph's calls
    named a checkpointed block that runs first by the plain one after it: the budget
    planner's blocks, shardc.passes.recompute.find_blocks, pair these names with the joint
    graph's calls in order.)"""
    calls: list[tuple[fx.Node, BodyCall]] = []
    seen: set[int] = set()
    _describe_in(gm, block_of_param, calls, seen)
    for owner in gm.modules():  # submodules no call reaches (none expected): as before, last
        if isinstance(owner, fx.GraphModule) and id(owner) not in seen:
            _describe_in(owner, block_of_param, calls, seen)
    return calls


def _describe_in(gm: fx.GraphModule, block_of_param, calls: list, seen: set[int]) -> None:
    """Append the body calls of ``gm`` and, where a node runs a subgraph (a higher-order op's
    ``get_attr`` operand), of that subgraph, in graph order; each subgraph once."""
    seen.add(id(gm))
    for node in gm.graph.nodes:
        if is_call(node, INVOKE_SUBGRAPH):
            described = _describe_call(gm, node, block_of_param)
            if described is not None:
                calls.append(described)
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            sub = _attr(gm, arg.target) if arg.op == "get_attr" else None
            if isinstance(sub, fx.GraphModule) and id(sub) not in seen:
                _describe_in(sub, block_of_param, calls, seen)


def _attr(gm: fx.GraphModule, target: str) -> object:
    for part in target.split("."):
        gm = getattr(gm, part, None)
    return gm


def _describe_call(gm: fx.GraphModule, node: fx.Node, block_of_param
                   ) -> tuple[fx.Node, BodyCall] | None:
    """``node`` (a body call of ``gm``) described, or None: not a call of one block's body."""
    operands = node.args[2:]
    gathers = {i: gather_of(a) for i, a in enumerate(operands)}
    weights = tuple(i for i, g in gathers.items() if g is not None)
    if not weights:
        return None
    blocks = {block_of_param(GatherArgs.of(gathers[i]).fqn) for i in weights}
    block = blocks.pop() if len(blocks) == 1 else None
    if block is None:
        return None
    body = subgraph_module(node)
    return node, BodyCall(str(node.args[1]), block[0], block[1], weights,
                          input_signature(_placeholder_values(body)))


# Functions and tensor methods that draw random numbers (exact names: ``normalize`` does not).
_RANDOM_NAMES = frozenset({
    "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "normal_", "uniform_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "random_", "multinomial", "poisson", "rrelu", "rrelu_"})


def _random_call(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    if "scaled_dot_product" in name:
        dropout_p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return dropout_p != 0.0
    if "dropout" in name:
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return p != 0.0 and training is not False
    return name in _RANDOM_NAMES


def draws_random_numbers(body: fx.GraphModule, checkpointed: bool = False) -> bool:
    """Whether a body of Dynamo's graph draws random numbers (dropout with p > 0, SDPA's
    dropout_p, ``torch.rand*``...); ``checkpointed``: inside an activation-checkpointed region
    of the body. Recomputed under activation checkpointing, a body's random ops do not replay
    the forward's numbers, so such calls compile inline."""
    nodes = _checkpointed_nodes(body) if checkpointed else _all_nodes(body)
    return any(node.op in ("call_function", "call_method") and _random_call(node)
               for node in nodes)


def _all_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """The nodes of ``gm`` and of every subgraph module it holds."""
    for sub in gm.modules():
        if isinstance(sub, fx.GraphModule):
            yield from sub.graph.nodes


def _checkpointed_nodes(body: fx.GraphModule) -> Iterator[fx.Node]:
    """The nodes inside ``body``'s activation-checkpointed regions (subgraphs included)."""
    for node in _all_nodes(body):
        if node.op == "call_function" and "activation_checkpoint" in str(node.target):
            yield from _all_nodes(getattr(node.graph.owning_module, node.args[0].target))


def inline_body_calls(root: fx.GraphModule, calls: list[fx.Node]) -> int:
    """Replace each ``invoke_subgraph`` node of ``calls`` (in ``root``'s graph or its
    subgraphs') by a copy of its body's nodes; returns how many were inlined.

    Of what the inlining leaves unread, only the bodies' ``get_attr`` nodes and ``getitem``
    reads are removed (:func:`_drop_unread_reads`), never FX's dead code: Dynamo's graph is of
    torch-level calls, where FX takes an in-place method (``out.add_(bias)``, whose result
    nobody reads: transformers' MoE experts add their biases so) for pure, so its
    ``eliminate_dead_code`` dropped the add and then the bias's gather: a silently wrong
    forward and no gradient for the bias (s72, GPT-OSS with ``compile_blocks_once=False``).
    The rest of the unread code is AOTAutograd's to eliminate, on its functional graph."""
    owners = {m.graph: m for m in root.modules() if isinstance(m, fx.GraphModule)}
    for node in calls:
        _inline(owners[node.graph], node)
    for gm in owners.values():
        _drop_unread_reads(gm.graph)
        gm.delete_all_unused_submodules()
        gm.recompile()
    return len(calls)


def _drop_unread_reads(graph: fx.Graph) -> None:
    """Erase the unread ``get_attr`` nodes (an inlined call's subgraph) and unread
    ``operator.getitem`` calls of ``graph``: reads that change nothing, whatever they read."""
    for node in reversed(graph.nodes):
        if not node.users and (node.op == "get_attr" or is_call(node, operator.getitem)):
            graph.erase_node(node)


# Meta key of an inlined node (:func:`flattened`): the body calls it runs in, outermost first
# (each named by its call node in the flattened graph; absent or ``()``: the graph itself). Each
# call runs as a function of its own in Inductor's generated code, with its own buffer reuse.
BODY_SCOPE = "shardc_body_scope"


def flattened(gm: fx.GraphModule, module_stacks: bool = True, check: bool = True
              ) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """``gm`` itself and the identity map if it calls no body; else a copy of ``gm`` with every
    ``invoke_subgraph`` call (nested ones too) replaced by its body's nodes, and the map from
    ``gm``'s nodes to the copy's. Nothing is eliminated: a body computes its unused outputs too.

    Analyses that walk a step's ops in order see the ops a body runs where it runs them: the
    peak prediction counts a body's temporaries and each of its outputs with its own lifetime
    (the call's tuple of outputs is no single value), and the cost model prices its kernels.
    Each inlined node's ``meta[BODY_SCOPE]`` names the calls it runs in, and (``module_stacks``)
    its ``nn_module_stack`` the calling block's modules. ``check``: lint the copy. An analysis
    that reads neither stacks nor trusts an unchecked graph less than its own time (the peak
    prediction, at every compile: about 20,000 nodes copied at 64 blocks) turns both off."""
    if next(body_calls(gm), None) is None:
        return gm, {n: n for n in gm.graph.nodes}
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    returned = graph.graph_copy(gm.graph, mapping)
    # The output node reads every block's saved values (the forward's) or gradients: it gets its
    # arguments once, after the inlining; rewired at every call, it made this quadratic in the
    # number of blocks.
    output = graph.output(None)
    copy = lazy_graph_module(gm, graph)
    replaced: dict[fx.Node, object] = {}
    # One scan for the calls, then the calls each inlined body brings (nested bodies): a scan
    # from the graph's start after every inline made this quadratic in the number of blocks.
    pending = list(body_calls(copy))
    while pending:
        pending.extend(_inline(copy, pending.pop(), module_stacks, replaced))
    output.args = (fx.map_arg(returned, lambda n: _inlined_value(n, replaced)),)
    if check:
        copy.graph.lint()
    return copy, mapping


def _inlined_value(node: fx.Node, replaced: dict[fx.Node, object]) -> object:
    """What ``node`` stands for once the calls are inlined: itself, or the body output that the
    getitem it is (of a call's outputs) was replaced by, through nested calls."""
    value: object = node
    while isinstance(value, fx.Node) and value in replaced:
        value = replaced[value]
    return value


# A module path of Dynamo's (``L['self'].layers.0``), as opposed to a path through a closure.
_MODULE_PATH = re.compile(r"L\['self'\](\.\w+|\[\d+\])*")


def _place_in_block(copy: fx.Node, call: fx.Node) -> None:
    """Give an inlined node the module stack of the block that called the body: the body was
    traced once, for the first block of its group, so its nodes name that block's modules
    (``shardc.passes.recompute`` finds an inline block's nodes by the stack)."""
    outer = call.meta.get("nn_module_stack")
    inner = copy.meta.get("nn_module_stack")
    if not outer or inner is None:
        return
    copy.meta["nn_module_stack"] = {**outer, **{
        k: v for k, v in inner.items()
        if k not in outer and not (isinstance(v, tuple) and _MODULE_PATH.fullmatch(str(v[0])))}}


def _inline(gm: fx.GraphModule, node: fx.Node, module_stacks: bool = True,
            replaced: dict[fx.Node, object] | None = None) -> list[fx.Node]:
    """Replace the call ``node`` by a copy of its body's nodes; returns the body calls among
    the copied nodes (a body that calls another body). ``replaced``: where given, each getitem
    of the call's outputs is recorded there with the value that replaced it (for a node that
    gets its arguments after the inlining)."""
    body = getattr(gm, node.args[0].target)
    scope = (*node.meta.get(BODY_SCOPE, ()), node.name)  # this call, inside its callers
    env: dict[fx.Node, object] = dict(zip(body.graph.find_nodes(op="placeholder"),
                                          node.args[2:]))
    result = None
    nested: list[fx.Node] = []
    copied_from = env.__getitem__  # (a bound method: no Python frame per argument)
    with gm.graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.map_arg(inner.args[0], copied_from)
                continue
            if inner.op == "get_attr":
                name = unique_attr(gm, f"{node.name}_{inner.target}")
                value = getattr(body, inner.target)
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    # A tensor constant of the body (AOTAutograd's _tensor_constant<i>): a
                    # buffer, so that torch.fx knows what the get_attr reads.
                    gm.register_buffer(name, value, persistent=False)
                else:
                    setattr(gm, name, value)
                env[inner] = gm.graph.get_attr(name)
                env[inner].meta = dict(inner.meta)
                continue
            env[inner] = copied = copy_node(gm.graph, inner, copied_from)
            copied.meta[BODY_SCOPE] = scope
            if module_stacks:
                _place_in_block(copied, node)
            if is_call(inner, INVOKE_SUBGRAPH):
                nested.append(copied)
    # Each reader of the call's outputs rewired once (not once per output it reads: the forward's
    # output node reads every block's saved values, which made this quadratic in the blocks).
    picked = {user: result[user.args[1]] for user in node.users
              if is_call(user, operator.getitem)}
    if replaced is not None:
        replaced.update(picked)
    readers = dict.fromkeys(r for item in picked for r in item.users)
    for reader in readers:
        reader.args = fx.map_arg(reader.args, lambda n: picked.get(n, n))
        if reader.kwargs:  # (each assignment re-registers the reader's inputs)
            reader.kwargs = fx.map_arg(reader.kwargs, lambda n: picked.get(n, n))
    for item in picked:
        gm.graph.erase_node(item)
    gm.graph.erase_node(node)
    return nested


def unique_attr(gm: fx.GraphModule, base: str) -> str:
    """``base``, or ``base_<i>`` with the first ``i`` that names no attribute of ``gm``."""
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def add_body_variant(gm: fx.GraphModule, call: fx.Node, graph: fx.Graph, suffix: str,
                     meta_key: str, meta: object) -> fx.Node:
    """Register ``graph`` on ``gm`` as a variant of ``call``'s body (its attributes from the
    body; ``meta_key`` in the module's meta, what :func:`calls_by_marked_body` finds), named
    ``<body>_<suffix>``, and return a ``get_attr`` of it placed right after the body's."""
    body = getattr(gm, call.args[0].target)
    name = unique_attr(gm, f"{call.args[0].target}_{suffix}")
    variant = lazy_graph_module(body, graph)
    variant.meta[meta_key] = meta
    gm.add_submodule(name, variant)
    with gm.graph.inserting_after(call.args[0]):
        return gm.graph.get_attr(name)


def call_body_variant(gm: fx.GraphModule, call: fx.Node, attr: fx.Node, identifier: str,
                      val: tuple) -> fx.Node:
    """A call of the body ``attr`` (identifier ``identifier``, fake outputs ``val``) with
    ``call``'s operands, placed before ``call``; the caller moves ``call``'s readers to it and
    then :func:`drop_body_call`."""
    with gm.graph.inserting_before(call):
        new = gm.graph.call_function(INVOKE_SUBGRAPH, (attr, identifier, *call.args[2:]))
    new.meta = {**call.meta, "val": val}
    return new


def drop_body_call(gm: fx.GraphModule, call: fx.Node) -> None:
    """Erase ``call`` (no readers left), and its body's ``get_attr`` where no call reads it any
    more (that body is then not compiled)."""
    attr = call.args[0]
    gm.graph.erase_node(call)
    if not attr.users:
        gm.graph.erase_node(attr)


def calls_by_marked_body(gm: fx.GraphModule, meta_key: str) -> dict[str, int]:
    """The bodies of ``gm`` whose module meta has ``meta_key`` (the variants that
    ``prune_body_outputs`` and ``body_output_casts`` add), each with how many calls run it: what
    their plan notes count."""
    calls: dict[str, int] = {}
    for node in body_calls(gm):
        target = str(node.args[0].target)
        if meta_key in getattr(getattr(gm, target), "meta", {}):
            calls[target] = calls.get(target, 0) + 1
    return calls


def is_body_joint(gm: fx.GraphModule) -> bool:
    """A joint graph with no shardc collective: a body's (AOTAutograd partitions each body's
    joint graph through the region's partitioner before the region's own)."""
    return not any(is_call(n, GATHER_OP) or is_call(n, REDUCE_SCATTER_OP)
                   for n in gm.graph.nodes)


def tag_weight_recompute(gm: fx.GraphModule, weights: set[int]) -> int:
    """In a body's joint graph (placeholders ``primals_*`` in operand order, then tangents),
    tag nodes computed from the weight inputs at ``weights`` alone must-recompute; returns how
    many nodes were tagged.

    The backward's nodes too: one computed from weights alone (a transpose of a weight the body
    took transposed, ``input @ weight.T``, whose backward needs the weight itself) depends on
    no gradient, so torch's partitioner may compute it in the forward and save it, which would
    keep the gathered weight alive to the backward in that form (transformers' Falcon, s55)."""
    primals = [p for p in gm.graph.find_nodes(op="placeholder")
               if not p.name.startswith("tangents")]
    pure = {primals[i] for i in weights if i < len(primals)}
    tagged = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "recompute" in node.meta:  # the user's own checkpointing decides these
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in pure for i in inputs):
            pure.add(node)
            recompute_tag(node, CheckpointPolicy.MUST_RECOMPUTE)
            tagged += 1
    return tagged


def tag_lazy_bit_views_recompute(gm: fx.GraphModule) -> int:
    """In a body's joint graph, tag must-recompute the nodes whose value is a view with
    PyTorch's lazy conjugate or negative bit (``aten._conj``, ``aten._neg_view``: the backward
    of a product of complex tensors, e.g. rotary embeddings through ``view_as_complex``); returns
    how many were tagged.

    Saved, such a view would be an output of the forward body and an operand of the backward
    body's call, and torch 2.11's ``invoke_subgraph`` has no kernel for the Conjugate and
    Negative dispatch keys ("could not find kernel ... at dispatch key DispatchKey.Conjugate").
    torch's partitioner then saves the view's source and computes the view in the backward."""
    tagged = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or "recompute" in node.meta:
            continue
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and (value.is_conj() or value.is_neg()):
            recompute_tag(node, CheckpointPolicy.MUST_RECOMPUTE)
            tagged += 1
    return tagged


def _body_output_sources(gm: fx.GraphModule, node: fx.Node) -> list[object]:
    """For each output of the call ``node``: the placeholder index it returns unchanged, or the
    output node itself."""
    body = getattr(gm, node.args[0].target)
    places = body.graph.find_nodes(op="placeholder")
    (out,) = body.graph.find_nodes(op="output")
    return [places.index(r) if isinstance(r, fx.Node) and r.op == "placeholder" else r
            for r in out.args[0]]


def rewire_saved_inputs(gm: fx.GraphModule, duplicates: bool = False) -> int:
    """Where a forward body call returns one of its inputs unchanged (a value saved for its
    backward), make readers use the input itself; returns how many outputs were rewired.

    ``duplicates``: also where it returns one value at two positions (a sunk residual body's
    output that its backward saves too, ``shardc.passes.sink_residual``), make readers of the
    later position read the first: Inductor's outer graph sees the call's outputs as separate
    buffers and would reuse the first in place once its last reader ran (the final residual
    add), overwriting the saved copy."""
    count = 0
    for node in list(body_calls(gm)):
        ident = node.args[1]
        if not (isinstance(ident, str) and "fw" in ident):
            continue
        sources = _body_output_sources(gm, node)
        getters = {u.args[1]: u for u in node.users if is_call(u, operator.getitem)}
        for user in list(node.users):
            if not is_call(user, operator.getitem):
                continue
            source = sources[user.args[1]]
            if isinstance(source, int):
                user.replace_all_uses_with(node.args[2 + source])
                count += 1
            elif duplicates and isinstance(source, fx.Node):
                first = next(i for i, s in enumerate(sources) if s is source)
                if first == user.args[1]:
                    continue
                if first not in getters:
                    with gm.graph.inserting_after(node):
                        getters[first] = gm.graph.call_function(operator.getitem, (node, first))
                    getters[first].meta = dict(user.meta)
                user.replace_all_uses_with(getters[first])
                count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def weight_derived_outputs(gm: fx.GraphModule, node: fx.Node,
                           is_weight: callable) -> dict[int, fx.Node]:
    """The outputs of body call ``node`` that are computed from operands for which
    ``is_weight(operand)`` holds alone (the operands themselves included): each output's index
    and the first such operand it is computed from."""
    body = getattr(gm, node.args[0].target)
    places = body.graph.find_nodes(op="placeholder")
    source = {p: a for p, a in zip(places, node.args[2:]) if is_weight(a)}
    for inner in body.graph.nodes:
        if inner.op == "call_function" and inner.all_input_nodes and all(
                i in source for i in inner.all_input_nodes):
            source[inner] = source[inner.all_input_nodes[0]]
    (out,) = body.graph.find_nodes(op="output")
    return {i: source[r] for i, r in enumerate(out.args[0]) if r in source}


class TraceOnceMismatch(RuntimeError):
    """A ``shardc::body_call`` that cannot be turned into its first call's ``invoke_subgraph``."""


def node_value(node: object) -> object:
    """The (fake) value Dynamo or AOTAutograd recorded for ``node``; a non-node as it is."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_meta(value: object) -> tuple | None:
    """Shape, stride, dtype, device and requires_grad of a tensor, else None."""
    if not isinstance(value, torch.Tensor):
        return None
    return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device,
            value.requires_grad)


def _meta_of(node: object) -> tuple | None:
    return tensor_meta(node_value(node)) if isinstance(node, fx.Node) else None


def aliasing_pattern(nodes: list) -> tuple[int, ...]:
    """For each position, the first position holding the same node."""
    return tuple(next(j for j in range(i + 1) if nodes[j] is nodes[i]) for i in range(len(nodes)))


@dataclass
class _Anchor:
    call: fx.Node  # the first call's invoke_subgraph
    operands: list  # per subgraph operand: ("flat", position) or ("fixed", node)
    outputs: list[int]  # per flat output of the body: its index among the call's outputs
    inputs: list  # the flat inputs' metadata
    identity: tuple[int, ...]


def _anchor(node: fx.Node) -> _Anchor:
    slot, inputs, outputs = node.args
    calls = {o.args[0] for o in outputs if is_call(o, operator.getitem)}
    if len(calls) != 1 or len(outputs) != sum(1 for o in outputs if is_call(o, operator.getitem)):
        raise TraceOnceMismatch(f"slot {slot}: the first call's outputs are not all outputs of "
                                "one invoke_subgraph call")
    (call,) = calls
    if not is_call(call, INVOKE_SUBGRAPH):
        raise TraceOnceMismatch(f"slot {slot}: the first call is no invoke_subgraph call")
    operands = []
    for operand in call.args[2:]:
        position = next((i for i, n in enumerate(inputs) if n is operand), None)
        if position is not None:
            operands.append(("flat", position))
        elif isinstance(operand, fx.Node) and operand.op in ("placeholder", "get_attr"):
            operands.append(("fixed", operand))  # a free variable: the same for every call
        else:
            raise TraceOnceMismatch(f"slot {slot}: the first call's subgraph takes {operand}, "
                                    "neither an argument of the body nor a graph input")
    return _Anchor(call, operands, [o.args[1] for o in outputs], [_meta_of(n) for n in inputs],
                   aliasing_pattern(list(inputs)))


def rewrite_trace_once_calls(root: fx.GraphModule) -> int:
    """Turn every ``shardc::body_call`` of Dynamo's graph ``root`` (and of its subgraphs) into an
    ``invoke_subgraph`` call of the subgraph that Dynamo traced for the first call of the same
    slot in the same graph (``shardc.ops.body_call``), with the operands in that subgraph's
    placeholder order, and remove the anchors; returns how many calls were rewritten. Raises
    :class:`TraceOnceMismatch` if a call does not fit its first call (count, shapes, strides,
    dtypes, devices, requires_grad or identical arguments differ, or no first call)."""
    from shardc.ops.body_call import BODY_ANCHOR_OP, BODY_CALL_OP

    rewritten = 0
    for gm in [m for m in root.modules() if isinstance(m, fx.GraphModule)]:
        anchors: dict[int, _Anchor] = {}
        changed = False
        for node in list(gm.graph.nodes):
            if is_call(node, BODY_ANCHOR_OP):
                try:
                    anchors[node.args[0]] = _anchor(node)
                except TraceOnceMismatch:
                    # Its call is no traced body in this graph (torch 2.11: Dynamo broke the
                    # graph inside it and ran it eagerly, this graph resuming after it): the
                    # anchor only marks its outputs, and a later call of its slot here has no
                    # first call to share (raised at that call).
                    anchors.pop(node.args[0], None)
                outputs = node.args[2]
                for user in list(node.users):
                    if not is_call(user, operator.getitem):
                        raise TraceOnceMismatch(f"{node}: used other than by getitem")
                    user.replace_all_uses_with(outputs[user.args[1]])
                    gm.graph.erase_node(user)
                gm.graph.erase_node(node)
                changed = True
            elif is_call(node, BODY_CALL_OP):
                _rewrite_call(gm, node, anchors)
                rewritten += 1
                changed = True
        if changed:
            gm.graph.lint()
            gm.recompile()
    return rewritten


def _rewrite_call(gm: fx.GraphModule, node: fx.Node, anchors: dict[int, _Anchor]) -> None:
    slot, inputs = node.args
    anchor = anchors.get(slot)
    if anchor is None:
        raise TraceOnceMismatch(f"slot {slot}: {node} has no first call before it in its graph")
    metas = [_meta_of(n) for n in inputs]
    if len(inputs) != len(anchor.inputs) or metas != anchor.inputs or None in metas:
        raise TraceOnceMismatch(f"slot {slot}: {node}'s arguments differ from the first call's "
                                f"(count, shape, stride, dtype, device or requires_grad)")
    if aliasing_pattern(list(inputs)) != anchor.identity:
        raise TraceOnceMismatch(f"slot {slot}: {node}'s identical arguments differ from the "
                                "first call's")
    first = anchor.call
    operands = [inputs[x] if kind == "flat" else x for kind, x in anchor.operands]
    with gm.graph.inserting_before(node):
        call = gm.graph.call_function(INVOKE_SUBGRAPH, (first.args[0], first.args[1], *operands))
    call.meta = dict(node.meta)
    values = list(first.meta.get("example_value", ()))
    mine = node.meta.get("example_value")
    if isinstance(mine, (list, tuple)) and len(mine) == len(anchor.outputs) and values:
        for i, j in enumerate(anchor.outputs):
            values[j] = mine[i]
        for key in ("example_value", "val"):
            if key in first.meta:
                call.meta[key] = tuple(values)
    for user in list(node.users):
        if not is_call(user, operator.getitem):
            raise TraceOnceMismatch(f"{node}: used other than by getitem")
        user.args = (call, anchor.outputs[user.args[1]])
    gm.graph.erase_node(node)
