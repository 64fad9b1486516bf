"""Which kernels a graph becomes: aten ops grouped the way a fusing compiler (Inductor) fuses them.

The estimator (:mod:`shardc.planning.estimate`) prices kernels, not aten ops: a chain of
pointwise ops and reductions is one kernel that reads its inputs and writes its outputs once,
whatever it computes in between. Rules (Inductor's, simplified):

- views (and ``getitem``, ``detach``) are no kernel: their readers read the viewed tensor;
- matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``, convolutions) and fused
  attention (``_scaled_dot_product_*``, flash / efficient / cuDNN) are one kernel each;
- pointwise ops, reductions and the loops Inductor inlines (indexing, embedding lookups,
  padding, fills, concatenation, softmax and norm decompositions) fuse with their producers and
  readers of the same kind, and with other such ops that read the same tensor, when no kernel
  that is not fused (a matmul, a collective, another op) lies on a path between them (fusing
  across one would make a cycle), and their sizes are compatible (one iteration space divides
  the other: a row reduction and the rowwise ops after it);
- every other op (a scatter-add, a sort, an op Inductor falls back to) is a kernel of its own;
- a *split reduction* (:func:`is_split_reduction`: a reduction to fewer outputs than a GPU has
  SMs to spread them over, each over more elements than one block reduces, such as the amax
  of a whole tensor that FP8's per-tensor scaling takes per weight, activation and gradient)
  is two kernels, as Inductor splits it (``Reduction.num_splits``): the first reduces slices
  of the input and may fuse with the ops before it, the second combines the partial results.
  No op that reads its result can fuse with it or with the ops before it: they need the whole
  input reduced first (a grid-wide barrier), so an op that reads both the input and the
  result (FP8's quantize: ``x * scale(amax(x))``) reads the input a second time.

Legality is tracked per group with two bit sets over the graph's unfused kernels: those it
depends on (``after``) and those that depend on it (``before``); two groups may merge only if
neither's ``before`` meets the other's ``after`` (no unfused kernel on a path between them). So
ops that recompute from a saved tensor in the backward (a norm's statistics) fuse into the
kernel after the matmul that reads them, as Inductor schedules them, although the graph lists
them before it. (An earlier rule compared "epochs", the most unfused kernels on a path from the
inputs; it kept such ops apart and priced the backward's pointwise work about twice over.)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from shardc.passes.fx_utils import (
    has_tag,
    is_view,
    op_overload,
    size_hint,
    subgraph_module,
    tensor_nbytes,
)

VIEW, MATMUL, ATTENTION, FUSABLE, EXTERN = "view", "matmul", "attention", "fusable", "extern"

_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution",
                      "convolution_backward", "_grouped_mm", "_scaled_grouped_mm"})
_ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention",
                    "cudnn_attention")
# Not tagged pointwise/reduction in aten's schema, yet computed by Inductor as loops it fuses
# (or decomposed into such loops before lowering).
_FUSABLE = frozenset({
    "embedding", "gather", "index", "constant_pad_nd", "full", "full_like", "zeros", "ones",
    "zeros_like", "ones_like", "empty_like", "scalar_tensor", "arange", "iota", "tril", "triu",
    "slice_backward", "select_backward", "slice_scatter", "select_scatter", "cat", "stack",
    "clone", "_to_copy", "copy", "copy_", "where", "masked_fill", "fill", "repeat", "expand_copy",
    "_softmax", "_safe_softmax", "_log_softmax", "_softmax_backward_data",
    "_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward",
    "_fused_rms_norm", "_fused_rms_norm_backward", "nll_loss_forward", "nll_loss_backward",
    "silu_backward", "gelu_backward", "threshold_backward", "sigmoid_backward",
    "tanh_backward", "sum", "mean", "amax", "amin", "var_mean", "var", "std", "prod", "max",
    "min", "argmax", "argmin", "any", "all", "norm", "linalg_vector_norm", "cumsum",
    "convert_element_type", "split_with_sizes_copy", "unbind_copy",
})
# Ops that only relabel memory (aten view ops are found by their schema).
_ALIASES = frozenset({"detach", "alias", "_unsafe_view", "lift_fresh", "view", "reshape",
                      "_reshape_alias", "t", "transpose", "permute", "expand", "squeeze",
                      "unsqueeze", "slice", "select", "split", "split_with_sizes", "unbind",
                      "as_strided", "view_as_real", "view_as_complex", "_unsafe_view_copy"})


def base_name(node: fx.Node) -> str:
    """An op's name without its overload (``aten.mm.default`` -> ``mm``)."""
    op = op_overload(node)
    if op is not None:
        return op.overloadpacket.__name__
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def classify(node: fx.Node) -> str:
    """How a fusing compiler computes ``node``: one of ``view``, ``matmul``, ``attention``,
    ``fusable`` or ``extern`` (see the module docstring)."""
    if node.op != "call_function":
        return VIEW if node.op in ("placeholder", "get_attr", "output") else EXTERN
    if node.target is operator.getitem:
        return VIEW
    name = base_name(node)
    if any(mark in name for mark in _ATTENTION_MARKS):
        return ATTENTION
    if name in _MATMULS:
        return MATMUL
    if name in _ALIASES or is_view(node):
        return VIEW
    op = op_overload(node)
    if op is not None and op.namespace not in ("aten", "prims"):
        return EXTERN  # collectives, shardc's and other libraries' ops
    if name in _FUSABLE or has_tag(node, torch.Tag.pointwise) or has_tag(node, torch.Tag.reduction):
        return FUSABLE
    return EXTERN


@dataclass
class Kernel:
    """One kernel: its ops (graph order), what kind it is and the bytes it moves to and from
    device memory (fused intermediates excluded)."""

    kind: str
    nodes: list[fx.Node]
    read_bytes: float = 0.0
    write_bytes: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.write_bytes

    @property
    def last(self) -> fx.Node:
        return self.nodes[-1]


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return max((math.prod(size_hint(s) for s in v.shape) for v in vals
                if isinstance(v, torch.Tensor)), default=1)


def _iteration(node: fx.Node) -> int:
    """Elements a fused loop runs over: a reduction's input, else the output."""
    if has_tag(node, torch.Tag.reduction) and node.all_input_nodes:
        return max(_numel(node), _numel(node.all_input_nodes[0]))
    return _numel(node)


# Inductor splits a reduction into two kernels when it has fewer outputs than two per SM and each
# reduces more than 8192 elements (``choices.reduction_split_factor`` for an inner reduction on
# sm80/sm90; an H100 has 132 SMs, an H200 132, an A100 108: the smallest is taken, 2 x 108).
SPLIT_REDUCTION_MAX_OUTPUTS = 2 * 108
SPLIT_REDUCTION_MIN_ELEMENTS = 8192


def is_split_reduction(node: fx.Node) -> bool:
    """Whether a fusing compiler computes the reduction ``node`` in two kernels (see the module
    docstring): fewer than :data:`SPLIT_REDUCTION_MAX_OUTPUTS` outputs, each over more than
    :data:`SPLIT_REDUCTION_MIN_ELEMENTS` input elements."""
    if node.op != "call_function" or not has_tag(node, torch.Tag.reduction) \
            or not node.all_input_nodes:
        return False
    outputs, inputs = _numel(node), _numel(node.all_input_nodes[0])
    return outputs < SPLIT_REDUCTION_MAX_OUTPUTS \
        and inputs > SPLIT_REDUCTION_MIN_ELEMENTS * max(outputs, 1)


def _compatible(a: int, b: int) -> bool:
    lo, hi = min(a, b), max(a, b)
    return lo > 0 and hi % lo == 0


class _Groups:
    """Union-find over fusable nodes, each root remembering its group's largest iteration."""

    def __init__(self) -> None:
        self.parent: dict[fx.Node, fx.Node] = {}
        self.size: dict[fx.Node, int] = {}

    def add(self, node: fx.Node, iteration: int) -> None:
        self.parent[node] = node
        self.size[node] = iteration

    def find(self, node: fx.Node) -> fx.Node:
        root = node
        while self.parent[root] is not root:
            root = self.parent[root]
        while self.parent[node] is not root:
            self.parent[node], node = root, self.parent[node]
        return root

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra
            self.size[ra] = max(self.size[ra], self.size[rb])


def _root(node: fx.Node, kinds: dict[fx.Node, str]) -> fx.Node:
    """The node whose memory ``node`` views (itself if it is not a view)."""
    while kinds.get(node) == VIEW and node.op == "call_function" and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _unfused_reach(graph: fx.Graph, kinds: dict[fx.Node, str]
                   ) -> tuple[dict, dict, dict]:
    """Per node, the bit sets of the unfused kernels (matmuls, attention, other ops: each a bit)
    it depends on (``after``) and that depend on it (``before``), views and fusable ops passing
    them through; and the bits (``bit``). A split reduction (:func:`is_split_reduction`) has a
    bit too, a barrier between what it reads and what reads its result, though it fuses with
    the ops before it. Python ints as bit sets: linear passes, cheap at thousands of
    kernels."""
    bit: dict[fx.Node, int] = {}
    after: dict[fx.Node, int] = {}
    for node in graph.nodes:
        acc = 0
        for i in node.all_input_nodes:
            acc |= after.get(i, 0) | bit.get(i, 0)
        after[node] = acc
        if node.op == "call_function" and (kinds[node] not in (VIEW, FUSABLE)
                                           or (kinds[node] == FUSABLE
                                               and is_split_reduction(node))):
            bit[node] = 1 << len(bit)
    before: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        acc = 0
        for u in node.users:
            acc |= before.get(u, 0) | bit.get(u, 0)
        before[node] = acc
    return after, before, bit


def group_kernels(graph: fx.Graph, compute: list[fx.Node],
                  bodies: dict[fx.GraphModule, list[Kernel]] | None = None) -> list[Kernel]:
    """The kernels of ``graph``'s ``compute`` ops (the planner's positions; other nodes, such as
    collectives, are kernels of their own that are not returned but still keep fusion from
    crossing them), ordered by their last op's position. ``bodies``: each block body's kernels
    grouped so far in this call (a body is grouped once, whatever the number of its calls)."""
    bodies = {} if bodies is None else bodies
    in_compute = set(compute)
    kinds = {node: classify(node) for node in graph.nodes}
    after, before, bit = _unfused_reach(graph, kinds)
    groups = _Groups()
    g_after: dict[fx.Node, int] = {}  # per group root: the unfused kernels it depends on
    g_before: dict[fx.Node, int] = {}  # ... and those depending on it
    readers: dict[fx.Node, fx.Node] = {}  # tensor -> its first fusable reader
    splits: set[fx.Node] = set()  # group roots holding a split reduction
    for node in graph.nodes:
        if kinds[node] != FUSABLE or node not in in_compute:
            continue
        groups.add(node, _iteration(node))
        # A split reduction's group comes before its own barrier: nothing that reads its
        # result may join it.
        g_after[node], g_before[node] = after[node], before[node] | bit.get(node, 0)
        if node in bit:
            splits.add(node)
        for i in node.all_input_nodes:
            r = _root(i, kinds)
            # Vertical fusion with a fusable producer, or horizontal fusion with an earlier
            # reader of the same tensor (Inductor fuses kernels that share a read).
            vertical = r in groups.parent
            other = r if vertical else readers.setdefault(r, node)
            if other is node:
                continue
            a, b = groups.find(other), groups.find(node)
            if a is b or not _compatible(groups.size[a], groups.size[b]):
                continue
            if not vertical and (a in splits or b in splits):
                # A split reduction's first kernel iterates over slices of its input, not
                # over the input's shape: another reader of that input is computed in its
                # own kernel (inlined into its readers), not beside it.
                continue
            if g_before[a] & g_after[b] or g_before[b] & g_after[a]:
                continue  # an unfused kernel lies on a path between them: a cycle
            groups.union(a, b)
            root = groups.find(a)
            g_after[root] = g_after[a] | g_after[b]
            g_before[root] = g_before[a] | g_before[b]
            if a in splits or b in splits:
                splits.add(root)
    members: dict[fx.Node, list[fx.Node]] = {}
    kernels: list[Kernel] = []
    for node in compute:
        kind = kinds[node]
        if kind == VIEW:
            continue
        if kind == FUSABLE:
            members.setdefault(groups.find(node), []).append(node)
        else:
            kernels.append(Kernel(kind, [node]))
    for nodes in members.values():
        kernels.append(Kernel(FUSABLE, nodes))
        # The second kernel of each split reduction: it combines the first's partial results
        # (a few KiB: priced at the least a kernel takes), right after it.
        kernels += [Kernel(FUSABLE, [n], extra={"split_reduction_final": True})
                    for n in nodes if n in bit]
    position = {n: i for i, n in enumerate(compute)}
    for k in kernels:
        if not k.extra.get("split_reduction_final"):
            k.read_bytes, k.write_bytes = _traffic(k, kinds)
    kernels = [inner for k in kernels for inner in _expand_body_call(k, bodies)]
    kernels.sort(key=lambda k: position[anchor(k)])
    return kernels


def anchor(kernel: Kernel) -> fx.Node:
    """The op of the grouped graph where ``kernel`` runs: its last op, or the block body call
    (``invoke_subgraph``) whose body it belongs to."""
    return kernel.extra.get("call", kernel.last)


def _expand_body_call(kernel: Kernel, bodies: dict[fx.GraphModule, list[Kernel]]
                      ) -> list[Kernel]:
    """A compiled-once block body's call (``invoke_subgraph``) runs its body's kernels, each
    priced as if inline, all at the call; any other kernel is itself. ``bodies``: the kernels
    of the bodies grouped before (see :func:`group_kernels`), each call gets copies of them."""
    node = kernel.last
    body = subgraph_module(node) if len(kernel.nodes) == 1 else None
    if body is None:
        return [kernel]
    if body not in bodies:
        inner = [n for n in body.graph.nodes if n.op == "call_function"]
        bodies[body] = group_kernels(body.graph, inner, bodies)
    return [Kernel(k.kind, k.nodes, k.read_bytes, k.write_bytes, {**k.extra, "call": node})
            for k in bodies[body]]


def count_calls(nodes: list[fx.Node], name: str) -> int:
    """How many of ``nodes`` call the op ``name`` (:func:`base_name`), counting those a
    compiled-once block body's call (``invoke_subgraph``) runs once per call."""
    count = 0
    for node in nodes:
        if node.op != "call_function":
            continue
        if _is_body_call(node):
            body = subgraph_module(node)
            if body is not None:
                count += count_calls(list(body.graph.nodes), name)
        elif base_name(node) == name:
            count += 1
    return count


def _is_body_call(node: fx.Node) -> bool:
    return node.target is torch.ops.higher_order.invoke_subgraph


def _traffic(kernel: Kernel, kinds: dict[fx.Node, str]) -> tuple[float, float]:
    """Bytes a kernel reads (each outside tensor once, a view of a smaller tensor at that
    tensor's size) and writes (its values read outside it, or graph outputs)."""
    inside = set(kernel.nodes)
    reads: dict[fx.Node, int] = {}
    for node in kernel.nodes:
        for i in node.all_input_nodes:
            r = _root(i, kinds)
            if r in inside:
                continue
            size = tensor_nbytes(i.meta.get("val"))
            root_size = tensor_nbytes(r.meta.get("val"))
            size = min(size, root_size) if root_size else size
            reads[r] = max(reads.get(r, 0), size)
    writes = 0
    for node in kernel.nodes:
        if _read_outside(node, inside, kinds):
            writes += tensor_nbytes(node.meta.get("val"))
    return float(sum(reads.values())), float(writes)


def _read_outside(node: fx.Node, inside: set[fx.Node], kinds: dict[fx.Node, str]) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "output":
                return True
            if kinds.get(user) == VIEW:
                stack.append(user)
            elif user not in inside:
                return True
    return False
