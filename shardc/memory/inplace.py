"""Inductor's in-place update: a kernel that writes its output into an input's buffer.

Inductor's scheduler (``SchedulerNode.decide_inplace_update``, shared by its CPU and CUDA code
generation) lets a kernel it generates write its output into the buffer of one of its inputs,
instead of allocating a new one, when that input is read at the output's own index (elementwise,
same layout), has the output's dtype and storage size, is read by no other kernel still to run,
and is a buffer Inductor may overwrite: one computed in the graph, or a graph input that
AOTAutograd donates (a value the forward saved only for the backward; parameters, the forward's
inputs and tangents are never donated; in a region that calls block bodies, only where shardc
could order the saved values after every body's inputs: ``shardc.passes.body_donations``, which
stamps the backward's donated inputs). A block body's kernels overwrite only the body's own
buffers, never its inputs (the caller's). The generated code then reads ``bufN = input; del
input  # reuse``, so the input's buffer and the output's are one: they are never alive together.

E.g. the backward of ``F.cross_entropy(logits.float(), targets)``: the kernel computing the bf16
logits' gradient ``(softmax(logits) - onehot) * grad`` reads the saved bf16 logits elementwise as
their last reader, and writes the gradient into their buffer (docs/memory_budget.md).

:func:`inplace_reuses` finds these pairs in an FX graph as :mod:`shardc.memory.peak` models
Inductor's fusion (``inlined``: loops computed inside their readers' kernels).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from shardc.passes.body import BODY_SCOPE
from shardc.passes.body_donations import DONATED
from shardc.passes.fx_utils import has_tag, op_overload, view_users

# Namespaces of ops whose outputs Inductor may overwrite in place (lowered to its own loops or to
# extern kernels such as matmuls); other ops (collectives, shardc's own) are left out.
_OWN_NAMESPACES = frozenset({"aten", "prims"})
# Placeholders AOTAutograd never donates: the forward's inputs (parameters, data) and the
# backward's tangents; and shardc's communication pool.
_NOT_DONATED_PREFIXES = ("primals", "tangents", "shardc_comm_pool")


def _val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def _elementwise(node: fx.Node) -> bool:
    """A pointwise op: its output's element i reads its same-shaped inputs' element i."""
    return node.op == "call_function" and has_tag(node, torch.Tag.pointwise)


def _donated(nodes: list[fx.Node]) -> set[fx.Node]:
    """A backward's inputs that AOTAutograd donates to it. Where shardc's lowering stamped them
    (:data:`~shardc.passes.body_donations.DONATED`: torch's own rule, and the region's switch),
    those stamped; else, in a graph that calls no block body, the values the forward saved
    (placeholders before the tangents, named after the forward's nodes), less the forward's own
    inputs (``primals_*``) and saved views (a donated tensor aliases nothing). A graph without
    tangents (a forward, or one no AOTAutograd partition made) has none, and so has an unstamped
    one that calls bodies (compiled with donations off)."""
    inputs = [n for n in nodes if n.op == "placeholder"]
    if not any(n.name.startswith("tangents") for n in inputs):
        return set()
    if any(DONATED in n.meta for n in inputs):
        return {n for n in inputs if n.meta.get(DONATED)}
    if _calls_bodies(nodes):
        return set()
    out: set[fx.Node] = set()
    for node in inputs:
        if node.name.startswith("tangents"):
            break
        val = _val(node)
        if val is not None and not node.name.startswith(_NOT_DONATED_PREFIXES) \
                and not val._is_view():
            out.add(node)
    return out


def _calls_bodies(nodes: list[fx.Node]) -> bool:
    """Whether the graph calls block bodies (``invoke_subgraph``), or is a flattened copy of one
    that did (:func:`shardc.passes.body.flattened` marks the inlined nodes)."""
    return any(n.meta.get(BODY_SCOPE) or n.target is torch.ops.higher_order.invoke_subgraph
               for n in nodes)


def _overwritable(buf: fx.Node, donated: set[fx.Node]) -> bool:
    """Whether Inductor may write another kernel's output into ``buf``'s storage: a tensor an
    aten op computes (not a view), or a donated input (:func:`_donated`)."""
    if buf.op == "placeholder":
        return buf in donated
    op = op_overload(buf)
    return op is not None and op.namespace in _OWN_NAMESPACES and not op.is_view


def _owned(buf: fx.Node, out: fx.Node) -> bool:
    """Whether ``buf`` belongs to the function whose kernel writes ``out`` (a flattened graph's
    :data:`~shardc.passes.body.BODY_SCOPE`): computed there, or returned to it by a body it
    called. A block body's inputs are its caller's buffers, never overwritten by its kernels
    (none is at a donated position: ``shardc.passes.body_donations``)."""
    scope = out.meta.get(BODY_SCOPE, ())
    return buf.meta.get(BODY_SCOPE, ())[:len(scope)] == scope


def _same_index(read: fx.Node, buf: fx.Node, out: fx.Node) -> bool:
    """Whether reading ``read`` (``buf`` or a view of it) elementwise at ``out``'s index reads
    ``buf``'s storage at the index ``out`` is written at, with ``out``'s dtype and storage size
    (Inductor's ``can_inplace`` and ``can_match_buffer_size``)."""
    r, b, o = _val(read), _val(buf), _val(out)
    if r is None or b is None or o is None or r.shape != o.shape:
        return False
    if b.dtype != o.dtype or b.numel() != o.numel() or b.is_sparse or o.is_sparse:
        return False
    if read is buf:
        return b.stride() == o.stride()
    # A reshape of a contiguous buffer, read by a contiguous output: the same flat index.
    return (r.storage_offset() == 0 and r.is_contiguous() and b.is_contiguous()
            and o.is_contiguous() and math.prod(r.shape) == b.numel())


def _kernel_reads(out: fx.Node, inlined: set[fx.Node]) -> list[fx.Node]:
    """The values ``out``'s kernel reads at ``out``'s own index: its inputs, and through the
    same-shaped pointwise loops inlined into it, theirs (in the order its body reads them)."""
    shape = _val(out).shape
    reads: list[fx.Node] = []
    stack = list(reversed(out.all_input_nodes))
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        val = _val(node)
        if node in inlined:
            if _elementwise(node) and val is not None and val.shape == shape:
                stack.extend(reversed(node.all_input_nodes))
        elif val is not None:
            reads.append(node)
    return reads


def _kernels_reading(buf: fx.Node, inlined: set[fx.Node]) -> set[fx.Node]:
    """The nodes realized in memory (not inlined) that read ``buf`` or its views, directly or
    through loops inlined into them: the kernels (and the output) that read the buffer."""
    found: set[fx.Node] = set()
    stack, seen = [buf], set()
    while stack:
        for reader in view_users(stack.pop())[1]:
            if reader in seen:
                continue
            seen.add(reader)
            if reader in inlined:
                stack.append(reader)
            else:
                found.add(reader)
    return found


def inplace_reuses(nodes: list[fx.Node], inlined: set[fx.Node],
                   storage: dict[fx.Node, fx.Node], born: dict[fx.Node, int],
                   last: dict[fx.Node, int], size: dict[fx.Node, int]) -> dict[fx.Node, fx.Node]:
    """``{output: input buffer}`` for each kernel that writes its output into an input's buffer
    (see the module docstring), from the liveness :func:`peak.lifetimes_and_storage` computed:
    ``storage`` (each node's storage owner), ``born`` and ``last`` (positions where each buffer
    is written first and read last) and ``size`` (its bytes; 0: not counted, e.g. inlined).

    An output qualifies if it is a pointwise loop Inductor realizes (not ``inlined``); the input
    buffer if the output's kernel reads it elementwise at the output's index, it is counted,
    overwritable (:func:`_overwritable`), the kernel is its last reader (``last`` is the
    output's ``born``) and no other kernel reads it there. The first such input, in the order
    the kernel reads them, is taken; a buffer is taken once.
    """
    taken: dict[fx.Node, fx.Node] = {}
    claimed: set[fx.Node] = set()
    donated = _donated(nodes)
    for out in nodes:
        if not (size.get(out) and out not in inlined and _elementwise(out)
                and _val(out) is not None):  # (the cheap questions first)
            continue
        at = born[out]
        reads = _kernel_reads(out, inlined)
        for read in reads:
            buf = storage.get(read)
            if (buf is None or buf in claimed or not size.get(buf) or last.get(buf) != at
                    or born[buf] >= at or not _overwritable(buf, donated)
                    or not _owned(buf, out)):
                continue
            if not all(_same_index(r, buf, out) for r in reads if storage.get(r) is buf):
                continue  # read at another index too (Inductor: one index per buffer)
            if any(k is not out and born.get(k, -1) >= at for k in _kernels_reading(buf, inlined)):
                continue  # another kernel still to run reads it: Inductor keeps it
            taken[out] = buf
            claimed.add(buf)
            break
    return taken
