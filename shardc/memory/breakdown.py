"""The whole step's memory by category: what the predicted peak is made of.

:func:`step_breakdown` takes the value lifetimes that the peak prediction walks
(``shardc.memory.peak.lifetimes``) and sorts every value into a category by what produces it and
who reads it, so the step's memory can be drawn stacked over the schedule and the peak explained
("optimizer state 40 GiB, saved activations 15 GiB, ..."). The categories add up, at every
position, to exactly the bytes the peak prediction counts there.

A value's category, first rule that applies:

- *gradients*: an output of the backward graph (gradient shards after their reduce-scatter, the
  gradients of unsharded parameters);
- *saved activations*: an output of the forward graph (what the backward reads), and the
  backward's inputs other than parameter shards;
- *communication buffers*: what a collective sends (the packed bucket), what a reduce-scatter or
  all-reduce returns, and the static communication pool;
- *gathered parameters*: what an all-gather returns and the copies and casts computed from
  gathered values alone (the per-parameter views Inductor materializes before a matmul);
- *temporaries*: everything else (activations between their producer and last reader in the
  same graph, the optimizer's own temporaries).

Parameter shards, optimizer state and the *runtime workspaces* (cuBLAS's, a CUDA target's
only: ``shardc.memory.peak.predict_peak``'s ``runtime_bytes``) are the same at every position.
On a CUDA target every value counts as the caching allocator's block
(``shardc.memory.cuda_blocks``), so the categories still add up to the peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import fx

from shardc import _torch
from shardc.ops.pool import is_filled_copy
from shardc.passes.fx_utils import op_overload

if TYPE_CHECKING:
    from shardc.memory.peak import Lifetime

PARAM_SHARDS = "parameter shards"
OPTIMIZER = "optimizer state"
GRADIENTS = "gradients"
GATHERED = "gathered parameters"
SAVED = "saved activations"
TEMPORARIES = "temporaries"
COMM = "communication buffers"
# The runtime's own device memory (cuBLAS workspaces), counted on a CUDA target only
# (``shardc.memory.cuda_blocks``); 0 at every position of an exact (CPU) count.
RUNTIME = "runtime workspaces"
CATEGORIES = (PARAM_SHARDS, OPTIMIZER, GRADIENTS, GATHERED, SAVED, TEMPORARIES, COMM, RUNTIME)

_GATHERS = frozenset({_torch.funcol.all_gather_into_tensor.default,
                      _torch.funcol.all_gather_into_tensor_out.default})
_WAIT = _torch.funcol.wait_tensor.default
_aten = torch.ops.aten
# Kernels whose output is an activation even when every input is a gathered parameter.
_COMPUTE = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                      _aten.baddbmm.default, _aten.convolution.default})
MAX_POINTS = 1500  # positions kept per graph in the stored timeline (the peak always is)


def _collective(node: fx.Node):
    op = op_overload(node)
    if op is not None and op.namespace == "_c10d_functional" and op is not _WAIT:
        return op
    return None


def categorize(gm: fx.GraphModule, graph: str, storage_of: dict[fx.Node, fx.Node]
               ) -> dict[fx.Node, str]:
    """Category of every storage-owning node of ``gm`` (``graph``: "forward" or "backward";
    ``storage_of``: node -> the node owning its storage, as :func:`peak.lifetimes` resolves
    aliases)."""
    from shardc.passes.lower import POOL_PLACEHOLDER

    out: dict[fx.Node, str] = {}
    outputs = {storage_of.get(a, a) for a in gm.graph.output_node().all_input_nodes}
    collectives = {node: op for node in gm.graph.nodes if (op := _collective(node)) is not None}
    sent = {storage_of.get(a, a) for node in collectives for a in node.all_input_nodes}
    for node in gm.graph.nodes:
        if storage_of.get(node, node) is not node or node.op == "output":
            continue
        op = collectives.get(node)
        if node in outputs:
            out[node] = GRADIENTS if graph == "backward" else SAVED
        elif node.op == "placeholder":
            out[node] = COMM if node.name == POOL_PLACEHOLDER else (
                SAVED if graph == "backward" else TEMPORARIES)
        elif node in sent or (op is not None and op not in _GATHERS):
            out[node] = COMM
        elif op in _GATHERS:
            out[node] = GATHERED
        elif _from_gathered(node, out, storage_of) or is_filled_copy(node):
            out[node] = GATHERED
        else:
            out[node] = TEMPORARIES
    return out


def _from_gathered(node: fx.Node, known: dict[fx.Node, str],
                   storage_of: dict[fx.Node, fx.Node]) -> bool:
    """A copy, cast or slice computed from gathered parameters alone (not a matmul of them)."""
    if node.op != "call_function" or node.target in _COMPUTE:
        return False
    inputs = [storage_of.get(a, a) for a in node.all_input_nodes]
    return bool(inputs) and all(known.get(a) == GATHERED for a in inputs)


def category_timeline(lives: Sequence[Lifetime], categories: dict[fx.Node, str],
                      end: int) -> dict[str, list[int]]:
    """Bytes of each category alive at each position ``0..end`` (the positions of
    :func:`peak.liveness_peak`'s timeline). A graph's inputs count from position 0: they all
    exist when it starts (the graph's placeholders take positions but run no code)."""
    delta = {c: [0] * (end + 2) for c in CATEGORIES}
    for life in lives:
        if life.nbytes:
            d = delta[categories.get(life.node, TEMPORARIES)]
            d[0 if life.node.op == "placeholder" else life.born] += life.nbytes
            d[life.last + 1] -= life.nbytes
    return {cat: list(accumulate(d[:end + 1])) for cat, d in delta.items()}


def _sample(totals: list[int], limit: int = MAX_POINTS) -> list[int]:
    """At most ``limit`` positions of a timeline: in each window the one holding the most bytes
    (so the peak and the shape of the curve survive)."""
    n = len(totals)
    if n <= limit:
        return list(range(n))
    keep = []
    for w in range(limit):
        lo, hi = w * n // limit, (w + 1) * n // limit
        keep.append(max(range(lo, hi), key=totals.__getitem__))
    return keep


def graph_columns(timeline: dict[str, list[int]], constants: dict[str, int]) -> tuple[
        list[int], dict[str, list[int]]]:
    """(sampled positions, bytes per category at them) with the step-wide constants added."""
    totals = [sum(at) for at in zip(*(timeline[c] for c in CATEGORIES))]
    keep = _sample(totals)
    columns = {c: [timeline[c][i] + constants.get(c, 0) for i in keep] for c in CATEGORIES}
    return keep, columns


def largest_at(lives: Sequence[Lifetime], categories: dict[fx.Node, str], pos: int,
               top: int = 8) -> list[list]:
    """The ``top`` largest values alive at ``pos``: ``[name, category, bytes]``."""
    alive = [life for life in lives if life.nbytes and life.born <= pos <= life.last]
    alive.sort(key=lambda life: -life.nbytes)
    return [[life.node.name, categories.get(life.node, TEMPORARIES), life.nbytes]
            for life in alive[:top]]
