"""A block body's partitioned graphs without the generator-state wrappers of recomputed ops that
draw no random numbers (:func:`unwrap_drawless_ops`, after the body's partition).

torch's min-cut partitioner (``functionalize_rng_ops``) wraps every op that an activation
checkpoint recomputes and whose op is tagged ``nondeterministic_seeded`` so that the recompute
replays the forward's random numbers. Scaled-dot-product attention is tagged so whatever its
``dropout_p``: with ``dropout_p`` 0 (or attention in eval) it draws nothing, and the wrappers
only carry a generator state that no kernel reads. Two forms:

* CPU (and CUDA with ``graphsafe_rng_functionalization`` off): the forward runs the op as
  ``run_and_save_rng_state(op, *args)``, whose state (``[0]``) it returns among its saved values;
  the backward takes it as a placeholder (``rng_state_output_*``) and recomputes
  ``run_with_rng_state(state, op, *args)``. The k-th state the forward returns is the k-th such
  placeholder of the backward (the partitioner adds both in one loop, and AOTAutograd hands
  saved values over by position), so they are dropped pairwise.
* CUDA's graph-safe form: each graph runs ``graphsafe_run_with_rng_state(op, *args,
  rng_state=g)`` with a generator placeholder of its own (``fwd_rng_state_*`` /
  ``bwd_rng_state_*``) that AOTAutograd threads from the region's inputs; nothing is saved.

Until s76 such bodies compiled inline under Inductor (every block on its own), after a failure
in s43 to lower a shared body's backward given the saved state; in s76 a body with the wrappers
kept compiled and trained at parity on CPU (torch 2.11, 2.13) and on one H100 (graph-safe form,
torch 2.11), so undoing them is not what makes sharing work: it drops each call's saved state
(and its save and restore) and, on CUDA, the generator states torch threads through the region
for every call. Ops that do draw numbers keep their wrappers: their bodies compile inline
anyway (``shardc.passes.body.draws_random_numbers(checkpointed=True)``: a shared body would draw
other numbers when recomputed).
"""

from __future__ import annotations

import numbers
import operator

from torch import fx

from shardc import _torch
from shardc.passes.fx_utils import is_call, recomputed_value

__all__ = ["draws_nothing", "unwrap_drawless_ops"]


def draws_nothing(op: object, args: tuple, kwargs: dict) -> bool:
    """Whether a call of ``op`` (an ATen overload tagged ``nondeterministic_seeded``) draws no
    random numbers: an attention kernel whose ``dropout_p`` is the constant 0. Any other op, or
    a symbolic ``dropout_p``, counts as drawing."""
    schema = getattr(op, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name != "dropout_p":
            continue
        if argument.name in kwargs:
            value = kwargs[argument.name]
        elif i < len(args) and not argument.kwarg_only:
            value = args[i]
        else:
            value = argument.default_value
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0
    return False


def unwrap_drawless_ops(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Undo, in a body's partitioned forward and backward, the generator-state wrappers of ops
    that draw no random numbers (:func:`draws_nothing`), both forms; recompiles the graphs it
    changed and returns how many wrappers it removed."""
    save, replay, graphsafe = _torch.rng_state_wrappers()
    removed = _unwrap_saved_states(fw, bw, save, replay)
    for gm in (fw, bw):
        removed += _unwrap_graphsafe(gm, graphsafe)
    if removed:
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
    return removed


def _unwrap_saved_states(fw: fx.GraphModule, bw: fx.GraphModule, save, replay) -> int:
    """The CPU form: each drawless op's forward wrapper, its state among the forward's outputs,
    the backward's state placeholder and its wrapper, removed together."""
    output = fw.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    states = [i for i, out in enumerate(outputs) if isinstance(out, fx.Node)
              and is_call(out, operator.getitem) and out.args[1] == 0
              and is_call(out.args[0], save)]
    replays = [n for n in bw.graph.nodes if is_call(n, replay)]
    placeholders = [p for p in bw.graph.find_nodes(op="placeholder")
                    if any(r.args[0] is p for r in replays)]
    if not states or len(states) != len(placeholders):
        return 0  # not the form this undoes: leave it as torch built it
    dropped = set()
    for position, placeholder in zip(states, placeholders):
        wrapper = outputs[position].args[0]
        op, *args = wrapper.args
        users = list(placeholder.users)
        if len(users) != 1 or users[0].args[1] is not op or not draws_nothing(
                op, tuple(args), wrapper.kwargs):
            continue
        # Both sides were copies of one node of the joint graph, whose meta (its value
        # included) torch kept on the forward's [1] only.
        result = [u for u in wrapper.users if u.args[1] == 1]
        meta = dict(result[0].meta) if result else {}
        if result:
            _replace_by_op(fw.graph, result[0], op, tuple(args), wrapper.kwargs,
                           before=wrapper)
        _replace_by_op(bw.graph, users[0], op, users[0].args[2:], users[0].kwargs, meta=meta)
        bw.graph.erase_node(placeholder)
        dropped.add(position)
    if not dropped:
        return 0
    output.args = (tuple(o for i, o in enumerate(outputs) if i not in dropped),)
    for position in dropped:
        state = outputs[position]
        wrapper = state.args[0]
        fw.graph.erase_node(state)
        if not wrapper.users:
            fw.graph.erase_node(wrapper)
    return len(dropped)


def _unwrap_graphsafe(gm: fx.GraphModule, graphsafe) -> int:
    """The graph-safe form: each drawless op's wrapper, and its generator placeholder once
    nothing else reads it."""
    removed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, graphsafe):
            continue
        op, *args = node.args
        kwargs = {k: v for k, v in node.kwargs.items() if k != "rng_state"}
        if not draws_nothing(op, tuple(args), kwargs):
            continue
        generator = node.kwargs.get("rng_state")
        _replace_by_op(gm.graph, node, op, tuple(args), kwargs)
        if isinstance(generator, fx.Node) and generator.op == "placeholder" \
                and not generator.users:
            gm.graph.erase_node(generator)
        removed += 1
    return removed


def _replace_by_op(graph: fx.Graph, node: fx.Node, op, args: tuple, kwargs: dict,
                   before: fx.Node | None = None, meta: dict | None = None) -> None:
    """``node`` (a wrapper, or the forward wrapper's ``[1]``) replaced by a plain call of
    ``op``, inserted before ``before`` (default: ``node``), with ``meta`` (default: ``node``'s
    own, where torch left one)."""
    with graph.inserting_before(before or node):
        call = graph.call_function(op, args, dict(kwargs))
    call.meta = dict(meta) if meta else dict(node.meta)
    if "val" not in call.meta:  # torch's graph-safe wrappers carry none
        value = recomputed_value(graph, call)
        if value is not None:
            call.meta["val"] = value
    node.replace_all_uses_with(call)
    graph.erase_node(node)
