"""Body calls that AOTAutograd does not re-trace (``opaque_body_calls``;
``shardc.ops.body_standin``; docs/design.md, "Body calls AOTAutograd does not re-trace").

* :func:`stand_in_later_calls` (Dynamo's graph, before AOTAutograd): every call of a body after
  its first one in the region's top-level graph becomes ``shardc::body_fwd``, whose autograd
  formula calls ``shardc::body_bwd``; AOTAutograd traces each as one opaque node. The first
  call of each body stays an ``invoke_subgraph`` call: torch traces, differentiates and
  partitions it as before (``ShardcPartitioner.partition_body``).
* :func:`restore_body_calls` (the region's joint graph, first thing in the partitioner, after
  torch stitched the first calls' partitioned graphs in): each stand-in pair becomes the
  ``invoke_subgraph`` calls of the first call's partitioned forward and backward that torch's
  ``run_joint_graph_passes_on_hops`` would have built for it (same subgraphs and identifiers,
  operands in the same order, the same saved-value ``getitem`` nodes), after checking counts,
  shapes, strides, dtypes and devices against the partitioned graphs; raises
  :class:`StandInMismatch` where they differ (the backend compiles the region again without
  stand-ins).
* :func:`undo_stand_ins` (Dynamo's graph): the calls as they were.

Under dynamic shapes the calls' ``SymInt`` operands (the region's size symbols, which Dynamo
passes to a body) go to the stand-in as its ``sizes``, and sizes are compared as expressions,
never evaluated (no guard is added).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import sympy
import torch
from torch import fx

from shardc.ops.body_standin import (
    BODY_BWD_OP,
    BODY_FWD_OP,
    OutputMeta,
    output_metas,
    record_outputs,
    recorded,
    size_expr,
)
from shardc.passes.body import INVOKE_SUBGRAPH, aliasing_pattern, node_value
from shardc.passes.fx_utils import is_call, overlapping, static_layout

__all__ = ["StandInMismatch", "StandIns", "restore_body_calls", "stand_in_later_calls",
           "undo_stand_ins"]


class StandInMismatch(RuntimeError):
    """A body stand-in that does not fit the first call's partitioned graphs."""


@dataclass
class StandIns:
    """The body calls of one Dynamo graph replaced by stand-ins, to undo them."""

    replaced: list[tuple[fx.Node, object, tuple]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why calls kept their invoke_subgraph

    def __len__(self) -> int:
        return len(self.replaced)


def _operand_meta(value: object) -> OutputMeta | tuple | None:
    """A tensor's metadata (sizes as ints or sympy expressions); ``("size", symbol)`` for a
    ``SymInt`` that is a plain symbol; else None."""
    if isinstance(value, torch.SymInt):
        expr = size_expr(value)
        return ("size", expr) if isinstance(expr, sympy.Symbol) else None
    return OutputMeta.of(value) if isinstance(value, torch.Tensor) else None


def _is_size(meta: OutputMeta | tuple) -> bool:
    return isinstance(meta, tuple)


@dataclass
class _First:
    operands: list[OutputMeta | tuple]
    identity: tuple[int, ...]
    outputs: tuple[OutputMeta, ...]
    key: str
    calls: int = 0


def _describe(node: fx.Node) -> tuple[list, tuple[OutputMeta, ...]] | str:
    """A call's operands' and outputs' metadata, or why it cannot have a stand-in."""
    operands = [_operand_meta(node_value(a)) for a in node.args[2:]]
    if any(not isinstance(a, fx.Node) for a in node.args[2:]) or None in operands:
        return "an operand is neither a tensor nor a size symbol"
    outputs = node_value(node)
    if not isinstance(outputs, (tuple, list)) or not outputs:
        return "Dynamo recorded no outputs for the call"
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        return "an output is no tensor"
    metas = tuple(OutputMeta.of(o) for o in outputs)
    if not any(m.requires_grad for m in metas):
        return "no output requires grad (a no_grad or eval region)"
    if not all(m.polynomial() for m in metas):
        return "an output's size is no polynomial in the size symbols"
    symbols = {m[1] for m in operands if _is_size(m)}
    if not set().union(*(m.symbols() for m in metas)) <= symbols:
        return "an output's size uses a symbol the call does not pass"
    return operands, metas


def stand_in_later_calls(gm: fx.GraphModule, calls: Iterable[fx.Node],
                         free_gradients: Collection[fx.Node] = ()) -> StandIns:
    """Replace each call of ``calls`` (shardc's body calls, ``invoke_subgraph`` nodes) in
    ``gm``'s top-level graph whose body was called before in that graph with the same operand
    and output metadata and aliasing pattern by ``shardc::body_fwd(key, i, operands)``; the
    node keeps its ``getitem`` users and meta. A call unlike every earlier call of its body
    keeps its ``invoke_subgraph``, and the later calls like it stand in for it. Calls inside
    other higher-order ops' subgraphs, calls with non-tensor or symbolic operands, and calls
    whose outputs need no gradient keep their ``invoke_subgraph`` (their reasons in
    ``StandIns.skipped``).

    ``free_gradients``: operands whose gradient the body computes for nothing (a sunk
    residual's zeros: its gradient is its pair's other half's, one node of the backward). A
    call that differs from another call of its body only in that such operands need no
    gradient stands in for that call, before it or after: AOTAutograd then traces one call of
    the body, not two (each traced call costs torch several re-traces of the body), and the
    call runs the same partitioned graphs torch would have shared between the two."""
    done = StandIns()
    wanted = {id(c) for c in calls}
    nested = {str(c.args[1]) for c in calls if c.graph is not gm.graph}
    free = {id(n) for n in free_gradients}
    described: list[tuple[fx.Node, str, list, tuple, tuple]] = []
    for node in list(gm.graph.nodes):
        if id(node) not in wanted or not is_call(node, INVOKE_SUBGRAPH):
            continue
        ident = str(node.args[1])
        if ident in nested:
            done.skipped.append(f"{ident}: the body is also called inside another "
                                "higher-order op (activation checkpointing)")
            continue
        description = _describe(node)
        if isinstance(description, str):
            done.skipped.append(f"{ident}: {description}")
            continue
        operands, outputs = description
        described.append((node, ident, operands, aliasing_pattern(list(node.args[2:])),
                          outputs))
    # The descriptions the calls have as Dynamo traced them.
    as_called = {(ident, tuple(operands), identity, outputs)
                 for _, ident, operands, identity, outputs in described}
    # Per body, the first call of each operand and output description: a later call with the
    # description of one of them stands in for it; a call unlike all of them is traced (torch
    # partitions it as another variant of the body, which restore_body_calls finds by fit).
    firsts: dict[str, list[_First]] = {}
    # Calls that stand in for a call their free gradients make them like (after the loop: that
    # call may come later in the graph).
    widened: list[tuple[fx.Node, str, list, tuple, tuple]] = []
    for node, ident, operands, identity, outputs in described:
        wider = _with_free_gradients(node, operands, free)
        if wider is not operands and (ident, tuple(wider), identity, outputs) in as_called:
            widened.append((node, ident, wider, identity, outputs))
            continue
        known = _known(firsts, ident, operands, identity, outputs)
        if known is None:
            positions = tuple(i for i, m in enumerate(operands) if _is_size(m))
            key = record_outputs(ident, outputs, tuple(operands[i][1] for i in positions),
                                 positions)
            firsts.setdefault(ident, []).append(_First(operands, identity, outputs, key))
            continue
        _replace_by_stand_in(node, known, operands, done)
    for node, ident, operands, identity, outputs in widened:
        _replace_by_stand_in(node, _known(firsts, ident, operands, identity, outputs), operands,
                             done)
    if done.replaced:
        gm.recompile()
    return done


def _with_free_gradients(node: fx.Node, operands: list, free: set[int]) -> list:
    """``operands`` (a call's described operands) with every operand of ``free`` described as
    requiring gradient; ``operands`` itself where that changes nothing."""
    if not free:
        return operands
    wider = [dataclasses.replace(m, requires_grad=True)
             if id(arg) in free and isinstance(m, OutputMeta) and not m.requires_grad else m
             for arg, m in zip(node.args[2:], operands)]
    return operands if wider == operands else wider


def _known(firsts: dict[str, list[_First]], ident: str, operands: list, identity: tuple,
           outputs: tuple) -> _First | None:
    return next((f for f in firsts.get(ident, ())
                 if (operands, identity, outputs) == (f.operands, f.identity, f.outputs)), None)


def _replace_by_stand_in(node: fx.Node, known: _First, operands: list, done: StandIns) -> None:
    known.calls += 1
    done.replaced.append((node, node.target, node.args))
    node.target = BODY_FWD_OP
    sizes = [a for a, m in zip(node.args[2:], operands) if _is_size(m)]
    tensors = [a for a, m in zip(node.args[2:], operands) if not _is_size(m)]
    node.args = (known.key, known.calls, tensors, sizes)


def undo_stand_ins(gm: fx.GraphModule, stand_ins: StandIns) -> None:
    """Put back the ``invoke_subgraph`` calls :func:`stand_in_later_calls` replaced."""
    for node, target, args in stand_ins.replaced:
        node.target, node.args = target, args
    if stand_ins.replaced:
        gm.recompile()
    stand_ins.replaced.clear()


# run_joint_graph_passes_on_hops (torch/_functorch/_aot_autograd/graph_compile.py) names a body's
# partitioned graphs after its backward's identifier, "bw_<identifier>_<variant>" (torch 2.13;
# the variant numbers backward traces for other tangent metadata): the forward
# "partitioned_fw_<identifier>_<variant>", the backward "partitioned_bw_<identifier>_<variant>".
# A backward identifier without the variant suffix is taken too.
_PARTITIONED_BW = "partitioned_bw_"


def _names_body(name: str, ident: str) -> bool:
    """Whether ``name`` is a partitioned backward's identifier of the body ``ident``."""
    rest = name.removeprefix(_PARTITIONED_BW + ident)
    return name.startswith(_PARTITIONED_BW) and rest != name and (
        rest == "" or re.fullmatch(r"_\d+", rest) is not None)


@dataclass
class _Partition:
    """One partitioned body (one backward variant), as its first call uses it."""

    fw_name: str
    bw_name: str
    fw: fx.GraphModule
    bw: fx.GraphModule
    fw_attr: fx.Node  # the first call's get_attr nodes (their meta is copied)
    bw_attr: fx.Node
    fw_call: fx.Node  # the first call's forward
    bw_call: fx.Node  # the first call's backward
    num_sym: int


def _outputs(gm: fx.GraphModule) -> list:
    return list(gm.graph.find_nodes(op="output")[0].args[0])


def _meta(value: object) -> tuple | None:
    """A tensor's shape, stride, dtype and device, a size's expression: compared, never
    evaluated (an evaluated symbolic comparison would add a guard)."""
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        return ("size", size_expr(value))
    if not isinstance(value, torch.Tensor):
        return None
    meta = OutputMeta.of(value)
    return (meta.shape, meta.stride, meta.dtype, meta.device)


def _val(value: object) -> object:
    return value.meta.get("val") if isinstance(value, fx.Node) else value


def _metas(values: Iterable) -> list:
    return [_meta(_val(v)) for v in values]


def _partitions(gm: fx.GraphModule, idents: set[str]) -> dict[str, list[_Partition]]:
    """Per Dynamo identifier of ``idents``, the partitioned bodies the joint graph's calls use."""
    found: dict[str, list[_Partition]] = {}
    for node in gm.graph.nodes:
        if not is_call(node, INVOKE_SUBGRAPH) or not isinstance(node.args[1], str):
            continue
        ident = next((i for i in idents if _names_body(node.args[1], i)), None)
        if ident is None:
            continue
        fw_name = "partitioned_fw_" + node.args[1].removeprefix("partitioned_bw_")
        fw_call = _forward_of(gm, node, fw_name)
        if fw_call is None or any(p.bw_name == node.args[1] for p in found.get(ident, ())):
            continue
        fw = getattr(gm, fw_call.args[0].target)
        bw = getattr(gm, node.args[0].target)
        # The forward returns (*outputs, *saved, *symbolic sizes), the backward takes
        # (*symbolic sizes, *saved, *tangents).
        num_sym = sum(1 for s in _outputs(fw) if isinstance(s, fx.Node)
                      and not isinstance(s.meta.get("val"), torch.Tensor))
        found.setdefault(ident, []).append(_Partition(
            fw_name, node.args[1], fw, bw, fw_call.args[0], node.args[0], fw_call, node,
            num_sym))
    return found


def _forward_of(gm: fx.GraphModule, bw_call: fx.Node, fw_name: str) -> fx.Node | None:
    """The forward call of ``fw_name`` whose saved values the backward call ``bw_call`` takes
    (two traced calls of one body may share its partitioned graphs: a sunk residual's first
    call and its second); the first such call where it takes none."""
    for arg in bw_call.args[2:]:
        if is_call(arg, operator.getitem) and is_call(arg.args[0], INVOKE_SUBGRAPH) \
                and arg.args[0].args[1] == fw_name:
            return arg.args[0]
    return next((n for n in gm.graph.nodes if is_call(n, INVOKE_SUBGRAPH)
                 and n.args[1] == fw_name), None)


def _operands(stand_in: fx.Node) -> list:
    """The body's operands a forward stand-in ``(key, i, tensors, sizes)`` passes, in order."""
    key, _, tensors, sizes = stand_in.args
    return recorded(key).operands(list(tensors), list(sizes))


# torch's graph-safe RNG (CUDA) gives a partitioned body with random ops (a checkpointed SDPA's
# recompute) one more placeholder per generator, named so, after its operands; its calls get
# them when the partitioner threads the region's generator states through every call
# (``thread_graphsafe_rng_from_hops``, after shardc's joint passes), restored calls alike.
_RNG_STATE = re.compile(r"(fwd|bwd)_rng_state")


def _body_inputs(gm: fx.GraphModule) -> list[fx.Node] | None:
    """A partitioned body's placeholders its calls pass (its generator states not yet
    threaded: the trailing ones), or None where such a placeholder is followed by another."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    rng = [_RNG_STATE.match(p.name) is not None for p in placeholders]
    num = len(placeholders) - sum(rng)
    return None if any(rng[:num]) else placeholders[:num]


def _fit(stand_in: fx.Node, bw: fx.Node | None, part: _Partition, num_outputs: int) -> str | None:
    """Why ``part`` cannot replace the stand-in pair, or None."""
    outputs = _outputs(part.fw)
    num_saved = len(outputs) - num_outputs - part.num_sym
    if num_saved < 0:
        return "the partitioned forward returns fewer values than the body"
    operands = _operands(stand_in)
    placeholders = _body_inputs(part.fw)
    if placeholders is None or _metas(operands) != _metas(placeholders):
        return "the operands differ from the partitioned forward's inputs"
    mine = [u for u in stand_in.users]
    got = {u.args[1]: u for u in mine if is_call(u, operator.getitem)}
    if len(got) != len(mine):
        return "a stand-in output is read other than by getitem"
    for i, user in got.items():
        if i >= num_outputs or not _same_but_layout(_meta(_val(user)), _meta(_val(outputs[i]))):
            return f"output {i} differs from the partitioned forward's"
    if bw is None:
        return None
    for node in _first_saved_operands(part, num_outputs):
        if isinstance(node_value(node), torch.Tensor) and not _returned_by_first(part, node):
            return "the first call's backward takes a value its forward does not return"
    first_tangents = _first_tangents(part, num_outputs)
    tangents = list(bw.args[3])
    read = _tangents_read(part.bw, len(first_tangents))
    if len(tangents) != len(first_tangents) or not all(
            _same_but_layout(_meta(_val(first)), _meta(_val(mine)))
            for mine, first in zip(tangents, first_tangents)) or (
            aliasing_pattern([tangents[i] for i in read])
            != aliasing_pattern([first_tangents[i] for i in read])):
        return "the gradients the backward gets differ from the first call's"
    grads_for = _gradient_positions(bw)
    bw_outputs = _outputs(part.bw)
    for user in bw.users:
        if not is_call(user, operator.getitem):
            return "a stand-in gradient is read other than by getitem"
        position = grads_for[user.args[1]]
        if position >= len(bw_outputs) or not isinstance(bw_outputs[position], fx.Node):
            return f"the partitioned backward computes no gradient for operand {position}"
        if not _same_but_layout(_meta(node_value(user)), _meta(node_value(bw_outputs[position]))):
            return f"the gradient of operand {position} differs from the partitioned backward's"
    return None


def _same_but_layout(claimed: tuple | None, actual: tuple | None) -> bool:
    """Whether a stand-in's output or gradient (``claimed``: the layout Dynamo's trace of the
    first call gave the output, or the stand-in's fake backward gives the gradient: its
    operand's) can be the partitioned forward's or backward's (``actual``): equal, or equal but
    for static strides, which :func:`_replace` copies the value into (a gradient's layout is
    its backward's: nn.MultiheadAttention's batch-first key and value get theirs transposed;
    an output's is its partitioned forward's: under Inductor's decompositions GPT-J's key for
    the cache comes out permuted where Dynamo's trace had it dense)."""
    if claimed == actual:
        return True
    if claimed is None or actual is None or claimed[0] == "size" or actual[0] == "size":
        return False
    static = all(isinstance(s, int) for s in (*claimed[1], *actual[1]))
    return static and (claimed[0], claimed[2], claimed[3]) == (actual[0], actual[2], actual[3])


def _tangents_read(bw: fx.GraphModule, count: int) -> list[int]:
    """The positions among a partitioned backward's ``count`` tangents (its last operands)
    that its graph reads. Which unread tangents alias others does not matter to it: a sunk
    body's backward reads one half of its pair's gradient for both (``tie_pair_tangents``),
    and the last call's two halves are one tensor once Inductor's joint passes drop the view
    between them. All of them where the placeholders cannot be read."""
    inputs = _body_inputs(bw)
    if inputs is None or len(inputs) < count:
        return list(range(count))
    tangents = inputs[len(inputs) - count:] if count else []
    return [i for i, t in enumerate(tangents) if t.users]


def _gradient_positions(bw: fx.Node) -> list[int]:
    """Per gradient a backward stand-in computes, the body operand it is for (its
    ``grads_for`` count the tensors only; the body's operands hold the sizes too)."""
    record = recorded(bw.args[0])
    return [record.operand_position(i) for i in bw.args[4]]


def _body_of(key: str) -> str:
    """The Dynamo identifier a stand-in's key names (``record_outputs``)."""
    return key.rsplit("/", 1)[0]


def restore_body_calls(gm: fx.GraphModule) -> int:
    """Turn each ``shardc::body_fwd`` / ``shardc::body_bwd`` pair of the joint graph ``gm`` into
    the partitioned ``invoke_subgraph`` calls torch builds for a body call (the forward returns
    the outputs, then the saved values read through new ``getitem`` nodes; the backward takes
    the saved values, then the tangents); returns how many forward stand-ins were replaced.
    Raises :class:`StandInMismatch` where one does not fit a partitioned body."""
    forwards = [n for n in gm.graph.nodes if is_call(n, BODY_FWD_OP)]
    if not forwards:
        return 0
    backwards = {(n.args[0], n.args[1]): n for n in gm.graph.nodes if is_call(n, BODY_BWD_OP)}
    partitions = _partitions(gm, {_body_of(n.args[0]) for n in forwards})
    for stand_in in forwards:
        key, call = stand_in.args[0], stand_in.args[1]
        ident = _body_of(key)
        num_outputs = len(output_metas(key))
        bw = backwards.pop((key, call), None)
        reasons = []
        chosen = None
        for part in partitions.get(ident, ()):
            reason = _fit(stand_in, bw, part, num_outputs)
            if reason is None:
                chosen = part
                break
            reasons.append(reason)
        if chosen is None:
            why = "; ".join(reasons) or "its body's first call was not partitioned"
            raise StandInMismatch(f"the stand-in of call {call} of body {ident}: {why}")
        _replace(gm, stand_in, bw, chosen, num_outputs)
    if backwards:
        raise StandInMismatch(f"{len(backwards)} body backward stand-in(s) without a forward")
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return len(forwards)


def _eager_input_vals(call: fx.Node, stand_in: fx.Node, first: fx.Node) -> None:
    """The values a call's operands had when traced (``meta["eager_input_vals"]``: Inductor's
    ``invoke_subgraph`` lowering constrains each operand to its strides), in the form of the
    first call's, ``(subgraph, identifier, *operands)``, from the stand-in's ``(key, i,
    operands)``; without either, none (Inductor then reads the operands' ``val``)."""
    mine = stand_in.meta.get("eager_input_vals")
    theirs = first.meta.get("eager_input_vals")
    call.meta.pop("eager_input_vals", None)
    if mine is None or theirs is None:
        return
    (args, kwargs), (first_args, _) = mine, theirs
    if len(args) == 4 and isinstance(args[2], (list, tuple)) and len(first_args) >= 2:
        # (Its non-tensor values are None: the key is the stand-in's own.)
        operands = recorded(stand_in.args[0]).operands(list(args[2]), list(args[3]))
        call.meta["eager_input_vals"] = ((*first_args[:2], *operands), kwargs)


def _first_tangents(part: _Partition, num_outputs: int) -> list:
    """The first call's backward operands after its saved values: the gradients of the body's
    outputs it is given."""
    return list(part.bw_call.args[2 + len(_outputs(part.fw)) - num_outputs:])


def _tangents_as_first(graph: fx.Graph, bw: fx.Node, part: _Partition,
                       num_outputs: int) -> list:
    """The stand-in backward ``bw``'s tangents, each copied into the first call's layout where
    it has other static strides (:func:`_same_but_layout`: the gradient of a last block's output
    that a bare ``.sum()`` reads is expanded, stride 0, the first call's is the next block's
    dense one): the partitioned backward was traced for the first call's. Also the tangents it
    does not read (a sunk pair's other half): Inductor's fake-tensor update after its post-grad
    passes requires every call of one subgraph to pass its operands in one layout."""
    tangents = list(bw.args[3])
    first = _first_tangents(part, num_outputs)
    for i in range(len(first)):
        mine, theirs = tangents[i], _val(first[i])
        if not isinstance(mine, fx.Node) or _meta(_val(mine)) == _meta(theirs):
            continue
        if overlapping(static_layout(theirs)):
            # The first call's tangent is expanded (x.sum(1) of the last block's output): no
            # other values fit its layout; passes.body_operand_layouts makes the placeholder
            # dense and copies every call's tangent into that.
            continue
        with graph.inserting_before(bw):
            tangents[i] = _strided_copy(graph, mine, theirs)
    return tangents


def _first_saved_operands(part: _Partition, num_outputs: int) -> list:
    """The first call's backward operands before its tangents: its forward's values after the
    body's ``num_outputs`` outputs (symbolic sizes, then saved tensors)."""
    return list(part.bw_call.args[2:2 + len(_outputs(part.fw)) - num_outputs])


def _returned_by_first(part: _Partition, node: object) -> bool:
    """Whether ``node`` is a ``getitem`` of the first call's forward."""
    return is_call(node, operator.getitem) and node.args[0] is part.fw_call


def _saved_operands(part: _Partition, saved: dict[int, fx.Node],
                    num_outputs: int) -> list[fx.Node]:
    """The backward's operands before its tangents, as the first call's backward takes them
    (its symbolic sizes, then its saved values: as many as the forward returns after the
    body's ``num_outputs`` outputs): each the new call's ``getitem`` of the same forward
    output, or the same node where the first call's is none (a size of the region)."""
    return [saved[node.args[1]] if _returned_by_first(part, node) else node
            for node in _first_saved_operands(part, num_outputs)]


def _replace(gm: fx.GraphModule, fw: fx.Node, bw: fx.Node | None, part: _Partition,
             num_outputs: int) -> None:
    """The node-for-node equivalent of run_joint_graph_passes_on_hops' step 3 for one call."""
    graph = gm.graph
    values = tuple(v.meta.get("val") if isinstance(v, fx.Node) else None
                   for v in _outputs(part.fw))
    with graph.inserting_after(fw):
        attr = graph.get_attr(part.fw_name)
        attr.meta = copy.copy(part.fw_attr.meta)
    with graph.inserting_after(attr):
        call = graph.call_function(INVOKE_SUBGRAPH, (attr, part.fw_name, *_operands(fw)))
        call.meta = copy.copy(fw.meta)
        call.meta["val"] = values
        _eager_input_vals(call, fw, part.fw_call)
    outputs = [u for u in fw.users if is_call(u, operator.getitem)]
    saved: dict[int, fx.Node] = {}
    with graph.inserting_after(call):  # as torch does: each one right after the call
        for i in range(num_outputs, len(values)):
            node = graph.call_function(operator.getitem, (call, i))
            node.meta = copy.copy(call.meta)
            node.meta["val"] = values[i]
            saved[i] = node
    fw.replace_all_uses_with(call)
    graph.erase_node(fw)
    for output in outputs:
        _keep_layout(graph, output, values[output.args[1]])
    if bw is None:
        return
    tangents = _tangents_as_first(graph, bw, part, num_outputs)
    grads_for = _gradient_positions(bw)
    with graph.inserting_after(bw):
        battr = graph.get_attr(part.bw_name)
        battr.meta = copy.copy(part.bw_attr.meta)
    with graph.inserting_after(battr):
        bcall = graph.call_function(INVOKE_SUBGRAPH, (battr, part.bw_name,
                                                      *_saved_operands(part, saved, num_outputs),
                                                      *tangents))
        bcall.meta = copy.copy(bw.meta)
        bcall.meta["val"] = tuple(v.meta.get("val") if isinstance(v, fx.Node) else None
                                  for v in _outputs(part.bw))
        bcall.meta.pop("eager_input_vals", None)
    for user in list(bw.users):
        user.args = (bcall, grads_for[user.args[1]])
        _keep_layout(graph, user, bcall.meta["val"][user.args[1]])
    graph.erase_node(bw)


def _keep_layout(graph: fx.Graph, value: fx.Node, actual: object) -> None:
    """Where the partitioned forward or backward computes ``value`` (a ``getitem`` of its call:
    an output or a gradient) in other strides than the stand-in said (:func:`_same_but_layout`),
    copy it into the stand-in's, so that the nodes traced on the stand-in's value read what they
    were traced for."""
    claimed = value.meta.get("val")
    if _meta(claimed) == _meta(actual):
        return
    value.meta["val"] = actual
    if overlapping(static_layout(claimed)):
        # An expand's layout (the first call's, traced with an expanded gradient) holds no
        # other values: the readers take the computed layout, and a body call among them gets
        # its placeholder's dense one (passes.body_operand_layouts).
        return
    with graph.inserting_after(value):
        copied = _strided_copy(graph, value, claimed)
    value.replace_all_uses_with(copied, delete_user_cb=lambda n: n is not copied)


def _strided_copy(graph: fx.Graph, value: fx.Node, like: torch.Tensor) -> fx.Node:
    """A node (at ``graph``'s insertion point) copying ``value`` into the strides of ``like``,
    a fake value of the same shape, dtype and device, which becomes its value."""
    copied = graph.call_function(torch.ops.prims.copy_strided.default,
                                 (value, list(like.stride())))
    copied.meta = copy.copy(value.meta)
    copied.meta["val"] = like
    return copied
