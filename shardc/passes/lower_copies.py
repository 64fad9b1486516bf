"""Lower CPU offload's copies (``Plan.copies``, :mod:`shardc.planning.copies`) into the graphs.

Each parameter's ``offload_to_device`` node becomes an ``offload_copy_start`` at its bucket's
planned copy issue position and an ``offload_copy_wait`` at the copy's wait position (before the
bucket's all-gather is issued, which then sends the device copy; over a one-rank group, where
the gather is elided, the cast of the device copy that replaces it is made right behind the
wait, as an ``offload_copy_cast``, so that the full-precision copy dies there).
Each ``offload_to_host`` node becomes a start where the plan issues its bucket's gradient copy
(once the reduced shards are handed out) and a wait at the end of the backward; the views
taken of the host gradient (its DTensor wrapping) move behind the wait. With ``ready_key`` (the
model's key), each bucket's starts are followed by one ``offload_grads_ready`` naming the
parameters whose host gradient is final once copied (:func:`final_host_grads`), for
``shardc.step_in_backward``. Each gradient copy's device source is then released, with the
compute stream waiting for the copy, one bucket later (:func:`_release_sources`), so that
Inductor cannot reuse its buffer while the copy stream reads it.
"""

from __future__ import annotations

import torch
from torch import fx

from shardc.ops.offload_copy import (
    COPY_CAST_OP,
    COPY_RELEASE_OP,
    COPY_START_OP,
    COPY_WAIT_OP,
    GRAD_D2H,
    READY_OP,
    copy_fqn,
    is_to_host,
)
from shardc.passes.fx_utils import call, is_view, view_chain, view_users
from shardc.planning.graph_view import GraphView
from shardc.planning.kernels import FUSABLE, classify
from shardc.planning.plan import Collective, CollectiveKind

_CONVERT = torch.ops.prims.convert_element_type.default


def _anchor(g: GraphView, gm: fx.GraphModule, pos: int) -> fx.Node:
    return g.compute[pos] if pos < g.end else gm.graph.find_nodes(op="output")[0]


def _retake(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A copy, at the insertion point, of the chain of views from a placeholder to ``node``
    (``node`` itself when it is no such chain: it already exists here)."""
    if view_chain(node) is None or node.op == "placeholder":
        return node
    base = _retake(graph, node.all_input_nodes[0])
    return graph.node_copy(node, lambda n: base)


def lower_h2d(gm: fx.GraphModule, g: GraphView, copies: list[Collective],
              elided: frozenset[int] = frozenset()) -> None:
    """Replace the graph's host->device copy nodes by planned start/wait pairs. ``elided``: the
    buckets whose gathers in this graph are elided (lowered to casts of the device copy before
    this runs); their casts move behind the copy's waits (:func:`_readers_after_waits`) and are
    made there (:func:`_cast_at_waits`)."""
    graph = gm.graph
    for c in (c for c in copies if c.kind == CollectiveKind.H2D_COPY and c.graph == g.name
              and c.origin == "shardc"):  # activation copies are in the graph already
        starts = []
        with graph.inserting_before(_anchor(g, gm, c.issue_pos)):
            for fqn in c.params:
                node = g.to_device[fqn]
                src, _, device, _pin = node.args
                val = node.meta["val"]
                starts.append(call(graph, COPY_START_OP,
                                   (_retake(graph, src), fqn, device, val.dtype, False)))
        with graph.inserting_before(_anchor(g, gm, c.wait_pos)):
            waits = [call(graph, COPY_WAIT_OP, (start,)) for start in starts]
        for fqn, start in zip(c.params, starts):
            node = g.to_device[fqn]
            node.replace_all_uses_with(start)
            graph.erase_node(node)
        if c.bucket in elided:
            _readers_after_waits(graph, set(starts), waits, set(g.compute))
            _cast_at_waits(graph, starts, waits[-1])


def _cast_at_waits(graph: fx.Graph, starts: list[fx.Node], last_wait: fx.Node) -> None:
    """Replace each cast of an elided bucket's device copies (``starts``; the casts the elided
    gathers became) that Inductor would realize in memory by an ``offload_copy_cast`` right
    behind the bucket's ``last_wait``, in the starts' order; the copy is read last there.
    Left as a cast, Inductor computes it right before its reader (a matmul, maybe a block
    later; the peak model's ``Fusion.deferred``), and the copy, twice the bf16 cast's bytes,
    stays alive until then. Casts that a reader may fuse are left (:func:`_realized_anyway`)."""
    anchor = last_wait
    for start in starts:
        for cast in [u for u in start.users if u.target is _CONVERT and _realized_anyway(u)]:
            with graph.inserting_after(anchor):
                made = call(graph, COPY_CAST_OP, (start, cast.args[1]))
            cast.replace_all_uses_with(made)
            graph.erase_node(cast)
            anchor = made


def _realized_anyway(cast: fx.Node) -> bool:
    """Whether no reader of ``cast`` (through views) is a kernel Inductor may fuse it into, so
    that it is computed into memory, rounded to its dtype, whatever the graph does: then it
    may be made anywhere after its input with the same bits. (Fused into a pointwise kernel,
    e.g. an RMSNorm's weight, Inductor does not round the value to bf16 in between: made
    apart, the values would change.)"""
    return all(classify(r) != FUSABLE for r in view_users(cast)[1])


def _readers_after_waits(graph: fx.Graph, starts: set[fx.Node], waits: list[fx.Node],
                         compute: set[fx.Node]) -> None:
    """Move the nodes downstream of a bucket's host->device copy ``starts`` that sit before
    its ``waits`` (consecutive nodes) right behind the last wait, in their order. An all-gather
    reads the copies after the waits (it is issued there), but an elided one (a one-rank group,
    ``shardc.passes.lower.elide``) became casts of the copies where the gather nodes were,
    which may precede the waits, or the starts themselves: the copies must be complete before
    anything reads them. Only those casts and their views may move: the plan waits a copy
    before its bucket's first reader, so a compute op of the graph (``compute``) among them
    is a lowering fault, raised rather than reordered."""
    first = waits[0]
    downstream, before = set(starts), []
    for n in graph.nodes:
        if n is first:
            break
        if n not in starts and any(i in downstream for i in n.all_input_nodes):
            downstream.add(n)
            before.append(n)  # graph order: inputs before their readers
    moved = [n for n in before if n in compute]
    if moved:
        raise RuntimeError(f"shardc: compute op(s) {[n.name for n in moved]} read a parameter's "
                           "host->device copy before the copy is waited (the plan waits it "
                           "before the bucket's first reader)")
    anchor = waits[-1]
    for n in before:
        anchor.append(n)
        anchor = n


def lower_d2h(gm: fx.GraphModule, g: GraphView, copies: list[Collective],
              ready_key: str = "") -> None:
    """Replace the graph's device->host gradient copies by planned start/wait pairs; with
    ``ready_key``, signal each bucket's final host gradients once their copies are started."""
    graph = gm.graph
    output = graph.find_nodes(op="output")[0]
    copies_of = _to_host_counts(graph)
    d2h = [c for c in copies if c.kind == CollectiveKind.D2H_COPY and c.graph == g.name
           and c.origin == "shardc"]  # activation copies are in the graph already
    # Every start first, each before its planned anchor: the moves below send the views of the
    # host gradients (compute nodes, some of them anchors of other buckets) to the end.
    starts: list[dict[str, fx.Node]] = []
    for c in d2h:
        started: dict[str, fx.Node] = {}
        for fqn in c.params:
            grad, _, dtype, pin = g.to_host[fqn].args
            # At the issue position, or after the gradient if the lowering placed it later
            # (the reduced shards are handed out right before their collective's wait anchor).
            with graph.inserting_before(_anchor(g, gm, c.issue_pos)):
                started[fqn] = call(graph, COPY_START_OP, (grad, fqn, "cpu", dtype, pin))
                # Host memory (the peak model's host values: shardc.memory.host.host_values).
                started[fqn].meta[GRAD_D2H] = True
            _after(graph, grad, started[fqn])
        starts.append(started)
    first_wait = None
    for started in starts:
        for fqn, start in started.items():
            node = g.to_host[fqn]
            with graph.inserting_before(output):
                wait = call(graph, COPY_WAIT_OP, (start,))
            first_wait = first_wait or wait
            node.replace_all_uses_with(start)
            graph.erase_node(node)
            _move_readers_behind(graph, start, wait)
    if ready_key:
        for started in starts:
            _signal_ready(graph, g, started, copies_of, ready_key)
    _release_sources(graph, starts, first_wait or output)


def _release_sources(graph: fx.Graph, starts: list[dict[str, fx.Node]], end: fx.Node) -> None:
    """One ``offload_copy_release(grad, host, True)`` per started gradient copy: the compute
    stream waits for bucket k's copies right after bucket k+1's copies start (the last
    bucket's before the host waits at the end), and until then the gradient stays a live value
    of the graph. Without it the copy's start is the gradient's last reader, and Inductor hands
    its buffer to a later kernel (``buf_b = buf_a  # reuse``) that the compute stream may run
    while the copy stream still reads it: the host would receive another tensor's values.
    (``record_stream`` does not help there: it holds blocks the caching allocator would reuse,
    not buffers Inductor reuses itself.) The same window of one bucket in flight as the
    activation copies' (``shardc.passes.offload_saved``). ``end``: the first of the host
    waits (the graph's output if none)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    buckets = sorted((s for s in starts if s), key=lambda s: min(index[n] for n in s.values()))
    for k, started in enumerate(buckets):
        if k + 1 < len(buckets):
            after = max(buckets[k + 1].values(), key=index.__getitem__)
            insert = graph.inserting_after(after)
        else:
            insert = graph.inserting_before(end)
        with insert:
            for start in started.values():
                call(graph, COPY_RELEASE_OP, (start.args[0], start, True))


def _to_host_counts(graph: fx.Graph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in graph.nodes:
        if is_to_host(node):
            counts[copy_fqn(node)] = counts.get(copy_fqn(node), 0) + 1
    return counts


def final_host_grads(g: GraphView, started: dict[str, fx.Node],
                     copies_of: dict[str, int]) -> list[str]:
    """The parameters of ``started`` (fqn -> its copy's start node) whose host gradient, once
    copied, is exactly the graph's gradient output for them: reduced in this graph (not stashed
    by ``no_sync``), copied once (a tied weight's two copies are summed after their waits), and
    read only through views up to the output (nothing is computed from it)."""
    final = []
    for fqn, start in started.items():
        if fqn not in g.reduces or copies_of.get(fqn, 0) != 1:
            continue
        stack, ok = [start], True
        while stack and ok:
            for user in stack.pop().users:
                if user.op == "output" or user.target is COPY_WAIT_OP:
                    continue
                if not is_view(user):
                    ok = False
                    break
                stack.append(user)
        if ok:
            final.append(fqn)
    return final


def _signal_ready(graph: fx.Graph, g: GraphView, started: dict[str, fx.Node],
                  copies_of: dict[str, int], key: str) -> None:
    """One ``offload_grads_ready`` after the last of the bucket's started copies."""
    final = final_host_grads(g, started, copies_of)
    if not final:
        return
    starts = {started[f] for f in final}
    last = None
    for n in graph.nodes:
        if n in starts:
            last = n
    with graph.inserting_after(last):
        call(graph, READY_OP, ([started[f] for f in final], "\n".join(final), key))


def _move_readers_behind(graph: fx.Graph, start: fx.Node, wait: fx.Node) -> None:
    """Move every node downstream of ``start`` (its views, the DTensor wrapping, the sum of a
    tied weight's two host gradients) behind ``wait``, in their order."""
    downstream, stack = set(), [start]
    while stack:
        for user in stack.pop().users:
            if user.op != "output" and user is not wait and user not in downstream:
                downstream.add(user)
                stack.append(user)
    anchor = wait
    for n in [n for n in graph.nodes if n in downstream]:
        anchor.append(n)
        anchor = n


def _after(graph: fx.Graph, first: fx.Node, node: fx.Node) -> None:
    """Move ``node`` right after ``first`` if it sits before it."""
    for n in graph.nodes:
        if n is node:
            first.append(node)
            return
        if n is first:
            return
