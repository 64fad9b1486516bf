"""FP8 joint-graph passes (``shardc.shard(..., fp8=...)``; see :mod:`shardc.runtime.fp8`).

Run on the joint graph (or a forward-only graph) before partitioning:

- :func:`merge_amax_allreduces`: every FP8 weight's scale comes from a ``shardc::fp8_amax`` node
  (a MAX all-reduce of one scalar). This pass replaces all of them by one MAX all-reduce of the
  stacked local amaxes, issued at the top of the graph, so a step costs one small collective
  instead of one per weight. The local amaxes depend only on parameter shards, so their
  computation moves to the top as well.
- :func:`dedupe_fp8_gathers`: a weight read twice in one forward is quantized and gathered once.
- :func:`tag_fp8_dequant`: with ``reshard_after_forward`` the dequantized weight (a multiply of
  the gathered FP8 weight) is recomputed in backward like the gather itself, never saved.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from shardc import _torch
from shardc.ops.gather import GATHER_OP
from shardc.ops.gather_args import GatherArgs
from shardc.passes.fx_utils import call, is_call, is_view, recompute_tag
from shardc.passes.reshard import reshards_after_forward
from shardc.planning.found import ORIGIN_META
from shardc.runtime.collectives import is_float8
from shardc.sharding.fp8 import FP8_AMAX_OP

aten = torch.ops.aten
funcol = _torch.funcol


@dataclass
class Fp8Summary:
    """What the FP8 passes did to one graph (reported in the plan's notes)."""

    weights: int = 0  # FP8 gathers
    amax_allreduces: int = 0  # MAX all-reduces left in the graph (one per process group)
    amax_bytes: int = 0  # bytes each all-reduce moves per rank

    def note(self) -> str:
        return (f"fp8: {self.weights} weight(s) gathered as float8; scales from "
                f"{self.amax_allreduces} amax all-reduce(s) (MAX, float32, "
                f"{self.amax_bytes} B) at the start of the forward")


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for inp in stack.pop().all_input_nodes:
            if inp.op == "call_function" and inp not in seen:
                seen.add(inp)
                stack.append(inp)
    return seen


def _top(graph: fx.Graph) -> fx.Node:
    """The last placeholder / attribute read: the computation may start after it."""
    last = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            last = node
        else:
            break
    return last if last is not None else graph._root


def merge_amax_allreduces(graph: fx.Graph) -> tuple[int, int]:
    """Replace the graph's ``fp8_amax`` nodes by one stacked MAX all-reduce per process group.

    Returns (all-reduces emitted, bytes of the largest). At world size 1 no collective is needed
    (the local amax is the global one)."""
    groups: dict[tuple[str, int], list[fx.Node]] = {}
    for node in graph.nodes:
        if is_call(node, FP8_AMAX_OP):
            _, group_name, world = node.args  # fp8_amax(amax, group_name, world)
            groups.setdefault((group_name, world), []).append(node)
    emitted = nbytes = 0
    for (group_name, world), nodes in groups.items():
        moved = set().union(*(_ancestors(n) for n in nodes))
        impure = [n for n in moved if n.target is GATHER_OP or n.is_impure()]
        if impure:  # never expected: amaxes read parameter shards only
            raise RuntimeError(f"shardc fp8: amax of {nodes[0]} depends on {impure[0]}")
        anchor = _top(graph)
        for node in [n for n in graph.nodes if n in moved]:  # graph order keeps topology
            anchor.append(node)
            anchor = node
        with graph.inserting_before(anchor.next):
            # cat of 1-element views, not stack: aten.stack is decomposed before Inductor.
            ones = [call(graph, aten.view.default, (n.args[0], [1])) for n in nodes]
            stacked = call(graph, aten.cat.default, (ones,))
            reduced = stacked
            if world > 1:
                handle = call(graph, funcol.all_reduce.default, (stacked, "max", group_name))
                handle.meta[ORIGIN_META] = (f"shardc FP8: the merged amax all-reduce of "
                                            f"{len(nodes)} weight(s), at the graph's start")
                reduced = call(graph, funcol.wait_tensor.default, (handle,))
                emitted += 1
                nbytes = max(nbytes, 4 * len(nodes))
            # The scales are tiny and come from a collective: keep them, never recompute.
            recompute_tag(reduced, CheckpointPolicy.MUST_SAVE)
            for i, node in enumerate(nodes):
                picked = call(graph, aten.select.int, (reduced, 0, i))
                node.replace_all_uses_with(picked)
        for node in nodes:
            graph.erase_node(node)
    return emitted, nbytes


def _fp8_gathers(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes
            if is_call(n, GATHER_OP) and is_float8(GatherArgs.of(n).shard.meta["val"].dtype)]


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, recursively, the inputs only it used (pure ops only)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or n.is_impure():
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)


def dedupe_fp8_gathers(graph: fx.Graph) -> int:
    """Keep one FP8 gather per weight (the first); returns how many were removed."""
    first: dict[str, fx.Node] = {}
    removed = 0
    for gather in _fp8_gathers(graph):
        keep = first.setdefault(GatherArgs.of(gather).fqn, gather)
        if keep is gather:
            continue
        gather.replace_all_uses_with(keep)
        _erase_dead(graph, gather)
        removed += 1
    return removed


_DEQUANT = {
    torch.ops.prims.convert_element_type.default,
    aten._to_copy.default,
    aten.mul.Tensor,
    aten.div.Tensor,
}


def tag_fp8_dequant(graph: fx.Graph) -> int:
    """Mark the dequantization of resharded FP8 gathers must-recompute; returns nodes tagged."""
    tagged = 0
    for gather in _fp8_gathers(graph):
        if not reshards_after_forward(gather):
            continue
        stack = [gather]
        while stack:
            for user in stack.pop().users:
                if user.op == "call_function" and (is_view(user) or user.target in _DEQUANT) \
                        and "recompute" not in user.meta:
                    recompute_tag(user, CheckpointPolicy.MUST_RECOMPUTE)
                    tagged += 1
                    stack.append(user)
    return tagged


def hoist_fp8_quantize(gm: fx.GraphModule | None) -> int:
    """Move the quantization of every FP8 gather's shard to the top of a partitioned graph.

    The scheduler issues an all-gather no earlier than its inputs exist; quantizing each shard
    next to its first use would pin the bucket's gather there and defeat prefetching. The
    quantized shards are a fraction of a shard each (1 byte per element), so computing them at
    the start costs little memory. Returns how many nodes moved."""
    if gm is None:
        return 0
    graph = gm.graph
    moved = set()
    for gather in _fp8_gathers(graph):
        root = GatherArgs.of(gather).shard
        moved |= _ancestors(gather) if root.op == "call_function" else set()
    if not moved or any(n.target is GATHER_OP for n in moved):
        return 0
    anchor = _top(graph)
    for node in [n for n in graph.nodes if n in moved]:
        anchor.append(node)
        anchor = node
    gm.recompile()
    return len(moved)


def prepare_fp8(graph: fx.Graph) -> Fp8Summary | None:
    """Run the FP8 passes on a joint or forward graph; ``None`` if it has no FP8 weight."""
    if not any(is_call(n, FP8_AMAX_OP) for n in graph.nodes) and not _fp8_gathers(graph):
        return None
    dedupe_fp8_gathers(graph)
    emitted, nbytes = merge_amax_allreduces(graph)
    tag_fp8_dequant(graph)
    for gather in _fp8_gathers(graph):
        # Keep the quantized shard (1 byte per element) for the backward's re-gather rather
        # than quantizing the high-precision shard again.
        recompute_tag(GatherArgs.of(gather).shard, CheckpointPolicy.MUST_SAVE)
    return Fp8Summary(len(_fp8_gathers(graph)), emitted, nbytes)
