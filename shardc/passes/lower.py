"""Apply a :class:`shardc.planning.plan.Plan` to a partitioned graph: flat bucketed collectives.

Each all-gather packs the bucket's shards (cast to the communication dtype, padded to the common
row count, flattened) into one buffer, issues ``all_gather_into_tensor`` at the planned position,
waits at the planned position and copies each parameter out of the gathered buffer. Without the
pool and with ``one_op_bucket_copies`` (opt-in), a send buffer of several tensors is filled by
one ``shardc::pool_pack`` into an ``empty`` of the graph, and under Inductor a bucket that one
block-body call reads is copied out by one ``shardc::unpack_into`` right before the call: one
op per bucket, not nodes and kernels per parameter, so Inductor's work does not grow with the
parameters of every block. Each
reduce-scatter packs the bucket's full gradients rank-major into one buffer, already divided by
the number of ranks they are averaged over (:func:`grad_divisor`), issues
``reduce_scatter_tensor``, and at its wait slices this rank's rows of every parameter out of the
reduced buffer itself. Collectives are torch functional collectives, so NCCL and gloo, eager FX
and Inductor all run them.

Collectives over a one-rank group (``Collective.elided``: world 1, or HSDP with shard size 1)
communicate nothing, so they are lowered to no collective at all: each gathered parameter
becomes its shard, cast to the compute dtype (a pointwise op that a fusing compiler folds into
its readers), and each reduced gradient the gradient, cast as the reduction would have cast it
(:func:`elide`). No pool buffer, no copy, no wait. Under Inductor a bucket's casts are one
``shardc::cast_into`` where they can be (``one_op_local_casts``, on by default). With HSDP's
replicas, the gradients are packed straight into the buffer the replicate all-reduce runs in.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from shardc import _torch
from shardc.ops.gather_args import GatherArgs, ReduceArgs
from shardc.ops.pool import CAST_INTO_OP, POOL_PACK_OP, POOL_UNPACK_OP, UNPACK_INTO_OP
from shardc.passes.body import INVOKE_SUBGRAPH
from shardc.passes.body_output_casts import ONE_RANK_GRAD_CAST
from shardc.passes.fx_utils import (
    call,
    dtype_itemsize,
    fake_mode_of,
    is_view,
    size_hint,
    view_chain_root,
    view_users,
)
from shardc.passes.lower_copies import lower_d2h, lower_h2d
from shardc.passes.lower_found import lower as lower_found
from shardc.planning.graph_view import GraphView, analyze
from shardc.planning.plan import Bucket, Collective, CollectiveKind, Plan
from shardc.runtime.collectives import is_float8, shard_rows
from shardc.runtime.comm_errors import COLLECTIVE_META

Kind = CollectiveKind
aten = torch.ops.aten
funcol = _torch.funcol


def _anchor(g: GraphView, gm: fx.GraphModule, pos: int) -> fx.Node:
    return g.compute[pos] if pos < g.end else gm.graph.find_nodes(op="output")[0]



def _pad_rows(graph: fx.Graph, x: fx.Node, rows: int) -> fx.Node:
    """``x`` zero-padded to ``rows`` rows; ``x`` itself where it has them and is computed in
    the graph (a cast, a gradient: the padding would only copy it; a graph input's view is
    still copied, so a collective sends a buffer of its own)."""
    val = x.meta["val"]
    if val.shape[0] == rows and view_chain_root(x) is None:
        return x
    pad = [0, 0] * (val.dim() - 1) + [0, rows - int(val.shape[0])]
    return call(graph, aten.constant_pad_nd.default, (x, pad, 0.0))


def _first_rows(graph: fx.Graph, x: fx.Node, rows: int) -> fx.Node:
    """``x``'s first ``rows`` rows (``x`` itself if it has no more)."""
    if x.meta["val"].shape[0] == rows:
        return x
    return call(graph, aten.slice.Tensor, (x, 0, 0, rows))


def _view(graph: fx.Graph, x: fx.Node, shape: list) -> fx.Node:
    """``x`` viewed as ``shape`` (``x`` itself if it has that shape)."""
    if list(x.meta["val"].shape) == list(shape):
        return x
    return call(graph, aten.view.default, (x, shape))


def _contiguous(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """``x``, copied to a dense layout only if it is not one (a gradient can be a transposed
    view, e.g. of an einsum, which cannot be flattened by a view)."""
    if x.meta["val"].is_contiguous():
        return x
    return call(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format})


def _retake_views(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A copy, at the insertion point, of the chain of views from a placeholder to ``node``."""
    if node.op == "placeholder":
        return node
    base = _retake_views(graph, node.all_input_nodes[0])
    return graph.node_copy(node, lambda n: base)


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    """Whether two nodes' values are the same tensor layout (dtype, sizes, strides, offset),
    compared only where all are static ints (a comparison must add no guard)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return False
    la = (*va.shape, *va.stride(), va.storage_offset())
    lb = (*vb.shape, *vb.stride(), vb.storage_offset())
    if not all(isinstance(x, int) for x in (*la, *lb)):
        return False
    return va.dtype == vb.dtype and la == lb


def _sent_shard(graph: fx.Graph, shard: fx.Node) -> fx.Node:
    """What an all-gather packs for ``shard``, usable at the insertion point: the shard itself,
    or if it is a chain of views of a graph input (a DTensor's local tensor), that input where
    the views change nothing (the usual case), else a copy of the chain here."""
    root = view_chain_root(shard)
    if root is None:
        return shard
    return root if _same_layout(shard, root) else _retake_views(graph, shard)


def _skip_identity_views(graph: fx.Graph, views: list[fx.Node]) -> None:
    """Read through each of ``views`` (the views taken of the reduced gradients, e.g. their
    DTensor wrapping; parents before children) that changes nothing and is the only reader of
    its input: its readers read the input (no two outputs come to share a node)."""
    alive = set(graph.nodes)
    for view in views:
        if view not in alive or len(view.all_input_nodes) != 1:
            continue
        base = view.all_input_nodes[0]
        if len(base.users) == 1 and base.op != "placeholder" and _same_layout(view, base):
            view.replace_all_uses_with(base)
            graph.erase_node(view)
            alive.discard(view)


def _erase_dead_views(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase each of ``nodes`` that is an unused view, and the unused views it was taken of
    (the gathers' original view chains of their shards, which lowering leaves unread)."""
    for node in nodes:
        while node.op == "call_function" and is_view(node) and not node.users:
            parent = node.all_input_nodes[0]
            graph.erase_node(node)
            node = parent


class PoolViews:
    """Views of the static communication pool (a uint8 tensor held by the graph module) at the
    offsets the plan assigned; ``None`` pool: collectives allocate their own buffers."""

    def __init__(self, graph: fx.Graph, pool: fx.Node | None, plan: Plan, poison: bool) -> None:
        self.graph, self.pool, self.plan, self.poison = graph, pool, plan, poison

    def view(self, c: Collective, role: str, dtype: torch.dtype, numel: int) -> fx.Node | None:
        if self.pool is None:
            return None
        offset = self.plan.pool_offsets[f"{c.id}.{role}"]
        nbytes = numel * dtype_itemsize(dtype)
        raw = call(self.graph, aten.slice.Tensor, (self.pool, 0, offset, offset + nbytes))
        return call(self.graph, aten.view.dtype, (raw, dtype))

    def unpack(self, flat: fx.Node, world: int, layouts: list[tuple[int, int, int, int]],
               shapes: list[list[int]]) -> list[fx.Node]:
        """Copies of a bucket's tensors out of the flat pool view ``flat`` (rank-major over
        ``world`` ranks; ``layouts``: each tensor's ``Bucket.layout`` entry, ``shapes``: its
        shape, the rows it keeps first), pinned to this place in the graph by one opaque op
        (``shardc::pool_unpack``), each read through one ``getitem``."""
        return _unpack(self.graph, flat, world, layouts, shapes)

    def release(self, view: fx.Node | None) -> None:
        """Debug mode: poison a buffer once it is dead, so a planning error that lets another live
        buffer share its bytes shows up as NaNs in the results."""
        if view is not None and self.poison and view.meta["val"].is_floating_point():
            call(self.graph, aten.fill_.Scalar, (view, float("nan")))


def _unpack(graph: fx.Graph, flat: fx.Node, world: int,
            layouts: list[tuple[int, int, int, int]], shapes: list[list[int]]) -> list[fx.Node]:
    """``shardc::pool_unpack`` of ``flat`` at the insertion point and one getitem per tensor
    (see :meth:`PoolViews.unpack`)."""
    sizes = [size_hint(d) for shape in shapes for d in shape]
    unpacked = call(graph, POOL_UNPACK_OP, (
        flat, world, [off for off, _, _, _ in layouts], [rows for _, rows, _, _ in layouts],
        sizes, [len(shape) for shape in shapes]))
    return [call(graph, operator.getitem, (unpacked, i)) for i in range(len(shapes))]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _static_shape(x: fx.Node) -> bool:
    val = x.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() >= 1 \
        and all(isinstance(d, int) for d in val.shape)


def _packs_in_one_op(tensors: list[fx.Node], sent_dtypes: list[torch.dtype],
                     dtype: torch.dtype, divisor: int) -> bool:
    """Whether a pool-less send buffer of ``tensors`` (cast to ``sent_dtypes``) is filled by one
    ``shardc::pool_pack`` (:func:`_pack_new`) instead of a cast, pad and view per tensor and a
    ``cat``: per-tensor nodes made Inductor lower, schedule and generate one copy kernel per
    parameter and block (compile time growing with depth, issue 18). The op computes the same
    values where the casts are to the buffer's dtype and the divisor is a power of two (an
    exact scaling: Inductor divides by a constant as a multiplication by its reciprocal on
    GPUs, so any other divisor keeps the per-tensor path). Several tensors only (one is sent
    as it is), static shapes, no float8 (its casts are FP8's own, ``passes/fp8.py``)."""
    return (len(tensors) > 1 and not is_float8(dtype) and divisor & (divisor - 1) == 0
            and all(d == dtype for d in sent_dtypes) and all(map(_static_shape, tensors)))


def _pack_new(graph: fx.Graph, shape: list[int], dtype: torch.dtype, tensors: list[fx.Node],
              rows: list[int], world: int, *, rank_major: bool, divisor: int) -> fx.Node:
    """A new send buffer of ``shape`` filled by one ``shardc::pool_pack`` of ``tensors`` (see
    its docstring for ``rows``, ``world``, ``rank_major``, ``divisor``). The buffer is an
    ``empty`` of the graph, so Inductor allocates it (and takes it from its reuse pool) where
    it allocated the ``cat`` it replaces, and the memory model counts it as that ``cat``
    (:mod:`shardc.memory.peak`); only the copies are opaque."""
    device = tensors[0].meta["val"].device
    out = call(graph, aten.empty.memory_format, (shape,), {"dtype": dtype, "device": device})
    call(graph, POOL_PACK_OP, (out, tensors, rows, world, rank_major, divisor))
    return out


def _comm_bytes(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """A float8 buffer's uint8 view for the collective (see ``collectives.as_comm_bytes``)."""
    if is_float8(x.meta["val"].dtype):
        return call(graph, aten.view.dtype, (x, torch.uint8))
    return x


def _issue_all_gather(graph, c: Collective, bucket: Bucket, gathers: dict, group: str,
                      pool: PoolViews, one_op: bool = False
                      ) -> tuple[fx.Node, fx.Node | None, fx.Node | None]:
    layout, numel = bucket.layout(c.params)
    shards = []
    for fqn in c.params:
        shard = GatherArgs.of(gathers[fqn]).shard
        shards.append(_sent_shard(graph, shard))
    send_view = pool.view(c, "send", _dtype(bucket.dtype), numel)
    if send_view is not None:
        rows = [layout[fqn][1] for fqn in c.params]
        call(graph, POOL_PACK_OP, (send_view, shards, rows, bucket.world, False))
        recv_view = pool.view(c, "recv", _dtype(bucket.dtype), numel * bucket.world)
        handle = call(graph, funcol.all_gather_into_tensor_out.default,
                      (_comm_bytes(graph, send_view), bucket.world, group),
                      {"out": _comm_bytes(graph, recv_view)})
        return handle, send_view, recv_view
    if one_op and _packs_in_one_op(
            shards, [GatherArgs.of(gathers[fqn]).compute_dtype or x.meta["val"].dtype
                     for fqn, x in zip(c.params, shards)], _dtype(bucket.dtype), 1):
        rows = [layout[fqn][1] for fqn in c.params]
        send = _pack_new(graph, [numel], _dtype(bucket.dtype), shards, rows, bucket.world,
                         rank_major=False, divisor=1)
        return call(graph, funcol.all_gather_into_tensor.default,
                    (send, bucket.world, group)), None, None
    pieces = []
    for fqn, x in zip(c.params, shards):
        compute_dtype = GatherArgs.of(gathers[fqn]).compute_dtype
        if compute_dtype is not None and compute_dtype != x.meta["val"].dtype:
            x = call(graph, torch.ops.prims.convert_element_type.default, (x, compute_dtype))
        x = _contiguous(graph, _pad_rows(graph, x, layout[fqn][1]))
        pieces.append(call(graph, aten.view.default, (x, [-1])))
    send = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, (pieces,))
    send = _comm_bytes(graph, send)
    return call(graph, funcol.all_gather_into_tensor.default, (send, bucket.world, group)), \
        None, None


def _wait_all_gather(graph, c: Collective, bucket: Bucket, gathers: dict, handle: fx.Node,
                     pool: PoolViews, buffers: tuple, fusing: bool = False):
    done = call(graph, funcol.wait_tensor.default, (handle,))
    if done.meta["val"].dtype != _dtype(bucket.dtype):  # float8 travelled as uint8
        done = call(graph, aten.view.dtype, (done, _dtype(bucket.dtype)))
    layout, total = bucket.layout(c.params)
    if buffers[1] is not None:
        # The pool: one opaque copy of the bucket's parameters out of it (see ``pool_ops``).
        shapes = [list(gathers[fqn].meta["val"].shape) for fqn in c.params]
        fulls = pool.unpack(done, bucket.world, [layout[fqn] for fqn in c.params], shapes)
        for fqn, full in zip(c.params, fulls):
            gathers[fqn].replace_all_uses_with(full)
            graph.erase_node(gathers[fqn])
        for view in buffers:
            pool.release(view)
        return
    table = call(graph, aten.view.default, (done, [bucket.world, total]))
    reader = _one_body_reader([gathers[fqn] for fqn in c.params]) if fusing else None
    if reader is not None and not is_float8(_dtype(bucket.dtype)):
        _unpack_before(graph, reader, table, c, bucket, gathers)
        for view in buffers:
            pool.release(view)
        return
    for fqn in c.params:
        gather = gathers[fqn]
        offset, rows, row_numel, dim0 = layout[fqn]
        cols = call(graph, aten.slice.Tensor, (table, 1, offset, offset + rows * row_numel))
        dense = call(graph, aten.clone.default, (cols,), {"memory_format": torch.contiguous_format})
        shape = list(gather.meta["val"].shape)
        full = call(graph, aten.view.default, (dense, [bucket.world * rows, *shape[1:]]))
        full = _first_rows(graph, full, dim0)
        gather.replace_all_uses_with(full)
        graph.erase_node(gather)
    for view in buffers:
        pool.release(view)


def _one_body_reader(gathers: list[fx.Node]) -> fx.Node | None:
    """The block-body call (``invoke_subgraph``) that is the one reader of every node of
    ``gathers`` (two or more), else None."""
    readers = {user for node in gathers for user in node.users}
    if len(gathers) < 2 or len(readers) != 1 or not all(node.users for node in gathers):
        return None
    reader = next(iter(readers))
    return reader if reader.op == "call_function" and reader.target is INVOKE_SUBGRAPH else None


def _unpack_before(graph: fx.Graph, reader: fx.Node, table: fx.Node, c: Collective,
                   bucket: Bucket, gathers: dict) -> None:
    """Copy a gathered bucket out of ``table`` (``(world, n)``) with one
    ``shardc::unpack_into`` right before ``reader``, the block-body call that reads all of it,
    into one ``empty`` per parameter, in place of a ``clone`` per parameter at the wait.

    The same memory under Inductor: a body call's inputs are realized right before the call,
    so the clones were allocated there too, each from Inductor's reuse pool as the ``empty``
    is, with the same size (padding rows included) and freed after the call alike; the bits
    are a copy's. What changes is Inductor's work: one extern call per bucket instead of a
    copy kernel per parameter to lower, schedule and generate (issue 18). The memory model
    treats each ``empty`` as the copy it replaces (:mod:`shardc.memory.peak`)."""
    layout, _ = bucket.layout(c.params)
    dtype = table.meta["val"].dtype
    with graph.inserting_before(reader):
        outs = []
        for fqn in c.params:
            _, rows, _, _ = layout[fqn]
            shape = [bucket.world * rows, *gathers[fqn].meta["val"].shape[1:]]
            outs.append(call(graph, aten.empty.memory_format, (shape,),
                             {"dtype": dtype, "device": table.meta["val"].device}))
        call(graph, UNPACK_INTO_OP, (table, bucket.world, [layout[f][0] for f in c.params], outs))
        for fqn, out in zip(c.params, outs):
            full = _first_rows(graph, out, layout[fqn][3])
            gathers[fqn].replace_all_uses_with(full)
            graph.erase_node(gathers[fqn])


def grad_divisor(bucket: Bucket) -> int:
    """The number of ranks a bucket's gradients are averaged over (shard ranks times replicas).

    The send buffer is divided by it while it is packed, so the reduce-scatter sums averages:
    the reduced buffer is the gradient itself and no averaged copy of it is made (a copy would
    keep two shard-sized buffers alive at once). Dividing before or after the sum gives the same
    bits when the divisor is a power of two; otherwise each addend is rounded once more.
    """
    return bucket.world * bucket.replicate


def _cast(graph: fx.Graph, x: fx.Node, dtype: torch.dtype | None) -> fx.Node:
    if dtype is None or dtype == x.meta["val"].dtype:
        return x
    return call(graph, torch.ops.prims.convert_element_type.default, (x, dtype))


def _same_shape(node: fx.Node, replacement: fx.Node, fqn: str) -> None:
    # By size hints: a check must add no guard (parameters' sizes are static anyway).
    want, got = ([size_hint(s) for s in n.meta["val"].shape] for n in (node, replacement))
    if want != got:
        raise RuntimeError(f"shardc lowering: {fqn} of a one-rank group has shape {tuple(got)}, "
                           f"expected {tuple(want)}; this is a shardc bug, please report it")


def elide(graph: fx.Graph, c: Collective, g: GraphView, handed: set[fx.Node],
          order: dict[fx.Node, int] | None = None) -> None:
    """Lower an elided collective (a one-rank group, not chained with an HSDP all-reduce): each
    gather node becomes its shard cast to the gathered dtype, each reduce node the gradient cast
    to the reduce dtype and then to the shard's dtype (what a one-rank reduce-scatter, whose
    divisor is 1, computes), contiguous like the reduced shard. Each replacement is inserted
    where the node was, so its inputs exist there and its readers follow it. ``handed``: the
    gradients already handed to a parameter in this graph; one handed twice (two parameters
    with the same gradient) is copied, so no two parameters' gradients share memory that an
    in-place update (gradient clipping) would then change twice; so is one the graph returns
    otherwise too. ``order`` (the graphs go to Inductor, ``one_op_local_casts``: each node's
    position in the graph before lowering, which insertions leave in order): a bucket's casts
    are one ``shardc::cast_into`` where :func:`_cast_bucket` can place it."""
    if order is not None and _cast_bucket(graph, c, g, handed, order):
        return
    for fqn in c.params:
        if c.kind == Kind.ALL_GATHER:
            node = g.gathers[fqn]
            with graph.inserting_before(node):
                new = _cast(graph, GatherArgs.of(node).shard, node.meta["val"].dtype)
        else:
            node = g.reduces[fqn]
            args = ReduceArgs.of(node)
            with graph.inserting_before(node):
                reduced = _cast(graph, args.grad, args.reduce_dtype)
                if reduced is not args.grad:  # (may move into the body: body_output_casts)
                    reduced.meta[ONE_RANK_GRAD_CAST] = True
                new = _cast(graph, reduced, args.out_dtype)
                new = _contiguous(graph, new)
                if view_chain_root(new) is not None or new in handed or any(
                        r.op == "output" for r in view_users(new)[1]):
                    # (nor a graph input, e.g. a tangent, or a value the graph already returns,
                    # e.g. an input's gradient: autograd may accumulate into that in place)
                    new = call(graph, aten.clone.default, (new,),
                               {"memory_format": torch.contiguous_format})
                handed.add(new)
        _same_shape(node, new, fqn)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _one_body_writer(values: list[fx.Node]) -> fx.Node | None:
    """The block-body call (``invoke_subgraph``) whose outputs are all of ``values`` (or views
    of them), else None: gradients that exist together from that call on, so that casting
    them in one op after the last does not keep any of them alive longer."""
    calls = set()
    for value in values:
        while is_view(value):
            value = value.all_input_nodes[0]
        if value.target is not operator.getitem:
            return None
        calls.add(value.args[0])
    call_ = next(iter(calls)) if len(calls) == 1 else None
    return call_ if call_ is not None and call_.target is INVOKE_SUBGRAPH else None


def _cast_bucket(graph: fx.Graph, c: Collective, g: GraphView, handed: set[fx.Node],
                 order: dict[fx.Node, int]) -> bool:
    """Lower an elided bucket's casts as one ``shardc::cast_into`` into an ``empty`` per
    parameter, the same values as :func:`elide`'s per-parameter casts; False (nothing changed)
    where it does not apply. Gathers: where one block-body call reads every weight of the
    bucket, right before that call (Inductor realizes a body call's operands there, so the
    casts' buffers were allocated there too). Reduces: where one body call computes every
    gradient of the bucket and each gradient's one cast is exact (to the reduce dtype, which is
    the shard's), where the last reduce node was, if every reader of the reduced gradients
    comes after it. Inductor then lowers one extern call
    per bucket instead of a cast kernel per parameter (issue 18); the memory model treats each
    ``empty`` as the cast it replaces (:mod:`shardc.memory.peak`)."""
    if c.kind == Kind.ALL_GATHER:
        nodes = [g.gathers[fqn] for fqn in c.params]
        reader = _one_body_reader(nodes)
        sources = [GatherArgs.of(node).shard for node in nodes]
        where = reader
    else:
        nodes = [g.reduces[fqn] for fqn in c.params]
        sources = [ReduceArgs.of(node).grad for node in nodes]
        if _one_body_writer(sources) is None or any(
                ReduceArgs.of(node).reduce_dtype not in (None, ReduceArgs.of(node).out_dtype)
                for node in nodes):
            return False
        last = max(nodes, key=order.__getitem__)
        if any(order.get(u, -1) <= order[last] for node in nodes for u in node.users):
            return False
        where = last
    if where is None or len(nodes) < 2:
        return False
    vals = [node.meta["val"] for node in nodes]
    if any(is_float8(v.dtype) or v.dtype == s.meta["val"].dtype or not _static_shape(node)
           or not _static_shape(s) or list(s.meta["val"].shape) != list(v.shape)
           for v, s, node in zip(vals, sources, nodes)):
        return False
    with graph.inserting_before(where):
        outs = [call(graph, aten.empty.memory_format, (list(v.shape),),
                     {"dtype": v.dtype, "device": v.device}) for v in vals]
        call(graph, CAST_INTO_OP, (sources, outs))
    for node, out in zip(nodes, outs):
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        handed.add(out)
    return True


def _issue_elided_reduce(graph, c: Collective, bucket: Bucket, reduces: dict,
                         pool: PoolViews) -> tuple[fx.Node, fx.Node | None]:
    """HSDP with a one-rank shard group: no reduce-scatter; the bucket's gradients, divided by
    every rank they are averaged over, are packed into one flat buffer (the pool's receive
    buffer) and all-reduced over the replicate group. Returns the all-reduce's handle and the
    pool buffer it reduces in place (None without the pool), as :func:`_wait_all_reduce` takes."""
    layout, numel = bucket.layout(c.params)
    grads = [ReduceArgs.of(reduces[fqn]).grad for fqn in c.params]
    divisor = grad_divisor(bucket)
    recv_view = pool.view(c, "recv", _dtype(bucket.reduce_dtype), numel)
    if recv_view is not None:
        rows = [layout[fqn][1] for fqn in c.params]
        call(graph, POOL_PACK_OP, (recv_view, grads, rows, 1, False, divisor))
        return call(graph, funcol.all_reduce_.default,
                    (recv_view, "sum", bucket.replicate_group)), recv_view
    pieces = []
    for fqn, x in zip(c.params, grads):
        x = _cast(graph, x, ReduceArgs.of(reduces[fqn]).reduce_dtype)
        if divisor != 1:
            x = call(graph, aten.div.Tensor, (x, divisor))
        pieces.append(call(graph, aten.view.default, (_contiguous(graph, x), [-1])))
    flat = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, (pieces,))
    return call(graph, funcol.all_reduce.default, (flat, "sum", bucket.replicate_group)), None


def _issue_reduce_scatter(graph, c: Collective, bucket: Bucket, reduces: dict, group: str,
                          pool: PoolViews, one_op: bool = False):
    layout, numel = bucket.layout(c.params)
    grads = [ReduceArgs.of(reduces[fqn]).grad for fqn in c.params]
    divisor = grad_divisor(bucket)
    send_view = pool.view(c, "send", _dtype(bucket.reduce_dtype), numel * bucket.world)
    if send_view is not None:
        table = call(graph, aten.view.default, (send_view, [bucket.world, numel]))
        rows = [layout[fqn][1] for fqn in c.params]
        call(graph, POOL_PACK_OP, (table, grads, rows, bucket.world, True, divisor))
        recv_view = pool.view(c, "recv", _dtype(bucket.reduce_dtype), numel)
        handle = call(graph, funcol.reduce_scatter_tensor_out.default,
                      (send_view, "sum", bucket.world, group), {"out": recv_view})
        return handle, send_view, recv_view
    if one_op and _packs_in_one_op(
            grads, [ReduceArgs.of(reduces[fqn]).reduce_dtype or x.meta["val"].dtype
                    for fqn, x in zip(c.params, grads)], _dtype(bucket.reduce_dtype), divisor):
        rows = [layout[fqn][1] for fqn in c.params]
        table = _pack_new(graph, [bucket.world, numel], _dtype(bucket.reduce_dtype), grads, rows,
                          bucket.world, rank_major=True, divisor=divisor)
        flat = call(graph, aten.view.default, (table, [-1]))
        return call(graph, funcol.reduce_scatter_tensor.default,
                    (flat, "sum", bucket.world, group)), None, None
    pieces = []
    for fqn, x in zip(c.params, grads):
        reduce_dtype = ReduceArgs.of(reduces[fqn]).reduce_dtype
        if reduce_dtype is not None and reduce_dtype != x.meta["val"].dtype:
            x = call(graph, torch.ops.prims.convert_element_type.default, (x, reduce_dtype))
        if divisor != 1:  # fused by a compiler into the cast that fills the send buffer
            x = call(graph, aten.div.Tensor, (x, divisor))
        _, rows, row_numel, _ = layout[fqn]
        x = _pad_rows(graph, x, rows * bucket.world)
        x = _contiguous(graph, x)
        pieces.append(call(graph, aten.view.default, (x, [bucket.world, rows * row_numel])))
    packed = pieces[0] if len(pieces) == 1 else call(graph, aten.cat.default, (pieces, 1))
    flat = call(graph, aten.view.default, (packed, [-1]))
    return call(graph, funcol.reduce_scatter_tensor.default,
                (flat, "sum", bucket.world, group)), None, None


def _wait_reduce_scatter(graph, c: Collective, bucket: Bucket, g: GraphView, handle, rank: int,
                         pool: PoolViews, buffers: tuple) -> tuple | None:
    """Wait a reduce-scatter and hand each parameter its rows; on an HSDP mesh, issue instead the
    bucket's all-reduce over the replicate group and return its handle and receive buffer (its
    wait hands out)."""
    done = call(graph, funcol.wait_tensor.default, (handle,))
    if bucket.replicate > 1 and buffers[1] is not None:
        # HSDP with the pool: all-reduce the reduced shard in place, in the receive buffer, whose
        # lifetime the plan extends to the all-reduce's wait (memory.comm_buffers).
        pool.release(buffers[0])
        return call(graph, funcol.all_reduce_.default,
                    (done, "sum", bucket.replicate_group)), buffers[1]
    if bucket.replicate > 1:
        # HSDP without the pool: one flat all-reduce of the bucket's reduced shard (a new tensor).
        return call(graph, funcol.all_reduce.default, (done, "sum", bucket.replicate_group)), None
    # With the pool, the gradients are copied out of it (they must not alias the pool) before
    # its buffers are released.
    _hand_out(graph, c, bucket, g, done, rank, pool if buffers[1] is not None else None)
    for view in buffers:
        pool.release(view)
    return None


def _wait_all_reduce(graph, c: Collective, bucket: Bucket, g: GraphView, handle, rank: int,
                     pool: PoolViews, recv: fx.Node | None):
    """HSDP: wait the replicate all-reduce (of addends already divided by every rank they are
    averaged over, :func:`grad_divisor`) and hand each parameter its rows; ``recv``: the pool
    buffer it reduced in place."""
    done = call(graph, funcol.wait_tensor.default, (handle,))
    # (with the pool, the gradients are copied out of it: they must not alias the pool)
    _hand_out(graph, c, bucket, g, done, rank, pool if recv is not None else None)
    if recv is not None:
        pool.release(recv)


def _hand_out(graph, c: Collective, bucket: Bucket, g: GraphView, done: fx.Node, rank: int,
              pool: PoolViews | None = None):
    """Replace each parameter's reduce node by its rows of the reduced flat shard ``done``:
    views of it, or with ``pool`` (``done`` is a pool buffer) new tensors copied out of it by
    one op."""
    layout, _ = bucket.layout(c.params)
    pieces = None
    if pool is not None:
        keep = [shard_rows(layout[fqn][3], bucket.world, rank) for fqn in c.params]
        shapes = [[k, *g.reduces[fqn].meta["val"].shape[1:]] for k, fqn in zip(keep, c.params)]
        pieces = pool.unpack(done, 1, [layout[fqn] for fqn in c.params], shapes)
    for i, fqn in enumerate(c.params):
        rs = g.reduces[fqn]
        offset, rows, row_numel, dim0 = layout[fqn]
        shape = list(rs.meta["val"].shape)
        if pieces is not None:
            piece = pieces[i]
        else:
            piece = call(graph, aten.slice.Tensor, (done, 0, offset, offset + rows * row_numel))
            piece = _view(graph, piece, [rows, *shape[1:]])
            piece = _first_rows(graph, piece, shard_rows(dim0, bucket.world, rank))
        out_dtype = ReduceArgs.of(rs).out_dtype
        if out_dtype != piece.meta["val"].dtype:
            piece = call(graph, torch.ops.prims.convert_element_type.default, (piece, out_dtype))
        views, _ = view_users(rs)
        rs.replace_all_uses_with(piece)
        graph.erase_node(rs)
        # Views of the reduced shard (e.g. re-wrapping it as the DTensor gradient) may sit
        # before the wait; move them behind it, in their original order (views are compute
        # nodes of the unlowered graph, so ``g.position`` orders them without a graph walk).
        anchor = piece
        for node in sorted(views, key=g.position.__getitem__):
            anchor.append(node)
            anchor = node


POOL_ATTR = "_shardc_comm_pool"
POOL_PLACEHOLDER = "shardc_comm_pool"


def add_pool_placeholder(gm: fx.GraphModule, pool: torch.Tensor) -> fx.Node:
    """A graph input named :data:`POOL_PLACEHOLDER` standing for ``pool``: for compilers
    (Inductor) that must see the pool as an input it mutates rather than a constant. It goes
    after the other inputs but before a backward's tangents (Inductor expects those last);
    whoever calls the compiled graph inserts the pool at that index of its arguments."""
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    before = [n for n in inputs if not n.name.startswith("tangents")] or inputs[:1]
    with gm.graph.inserting_after(before[-1]):
        node = gm.graph.placeholder(POOL_PLACEHOLDER)
    mode = fake_mode_of(gm.graph)
    if mode is not None:
        node.meta["val"] = mode.from_tensor(pool, static_shapes=True)
    return node


def _pool_node(gm: fx.GraphModule, pool: torch.Tensor) -> fx.Node:
    gm.register_buffer(POOL_ATTR, pool, persistent=False)
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        node = gm.graph.get_attr(POOL_ATTR)
    mode = fake_mode_of(gm.graph)
    if mode is not None:
        node.meta["val"] = mode.from_tensor(pool, static_shapes=True)
    return node


def apply_plan(
    gm: fx.GraphModule,
    plan: Plan,
    graph_name: str,
    rank: int,
    *,
    pool: torch.Tensor | fx.Node | None = None,
    poison: bool = False,
    grads_ready_key: str = "",
    fusing: bool = False,
    one_op: bool = False,
    one_op_casts: bool = False,
) -> fx.GraphModule:
    """Replace the shardc nodes of ``gm`` (the region's ``graph_name`` graph) by ``plan``.

    With ``pool`` (a uint8 tensor of ``plan.predicted['pool_bytes']``), every communication
    buffer is a view of it at its planned offset and the collectives write in place, so steps
    allocate no communication buffers; ``poison`` fills each buffer with NaN once it is dead.
    ``pool`` may instead be a graph node standing for it (:func:`add_pool_placeholder`).
    ``grads_ready_key``: CPU offload's model key; each bucket's final host gradients are
    signalled once their copies start (``shardc.step_in_backward``). ``one_op``
    (``ShardcOptions.one_op_bucket_copies``, off by default): without the pool, each send
    buffer of several tensors is filled by one op (:func:`_pack_new`), and with ``fusing``
    (the graphs go to Inductor, which realizes a block-body call's inputs right before the
    call) a bucket read by one body call is copied out by one op right before it
    (:func:`_unpack_before`); otherwise per parameter, a copy at the wait, as FX runs it.
    ``one_op_casts`` (``ShardcOptions.one_op_local_casts``), with ``fusing``: a one-rank
    group's casts one op per bucket where they can be (:func:`_cast_bucket`).
    """
    g = analyze(gm, graph_name)
    shards = [GatherArgs.of(node).shard for node in g.gathers.values()]
    grad_views = [v for node in g.reduces.values() for v in view_users(node)[0]]
    colls = [c for c in plan.collectives if c.graph == graph_name and c.origin == "shardc"]
    found = [c for c in plan.collectives if c.graph == graph_name and c.origin != "shardc"]
    handles: dict[str, tuple] = {}
    graph = gm.graph
    # One-rank groups: no collective (an elided reduce-scatter chained with an HSDP all-reduce
    # is lowered at its issue position: it packs what the all-reduce reduces).
    handed: set[fx.Node] = set()
    copied = {c.bucket for c in plan.copies if c.graph == graph_name}  # CPU offload's
    order = {n: i for i, n in enumerate(graph.nodes)} if fusing and one_op_casts else None
    for c in [c for c in colls if c.elided and not c.link]:
        elide(graph, c, g, handed, None if c.bucket in copied else order)
    colls = [c for c in colls if not c.elided or c.link]
    pool_node = pool if isinstance(pool, fx.Node) or pool is None else _pool_node(gm, pool)
    views = PoolViews(graph, pool_node if colls else None, plan, poison)
    # CPU offload: the host->device copies first (the all-gathers send their results; an
    # elided gather's cast reads its copy after the copy's wait).
    lower_h2d(gm, g, plan.copies, frozenset(c.bucket for c in plan.collectives
                                            if c.graph == graph_name and c.origin == "shardc"
                                            and c.kind == Kind.ALL_GATHER and c.elided))
    # At one position: waits of earlier issues first (their send buffers die before the next
    # bucket is packed, which then reuses their memory), then issues, then the waits of
    # collectives issued there, each in plan order.
    # HSDP's all-reduces are issued by their reduce-scatter's wait (they reduce its output).
    first_issued: dict[int, fx.Node] = {}
    for c in sorted((c for c in colls if c.kind != Kind.ALL_REDUCE), key=lambda c: c.issue_pos):
        bucket = plan.buckets[c.bucket]
        if c.kind == Kind.ALL_GATHER:
            group = GatherArgs.of(g.gathers[c.params[0]]).group_name
        else:
            group = ReduceArgs.of(g.reduces[c.params[0]]).group_name
        anchor = _anchor(g, gm, c.issue_pos)
        if c.issue_pos not in first_issued:
            first_issued[c.issue_pos] = anchor.prev
        with graph.inserting_before(anchor):
            if c.elided:
                handles[c.link] = _issue_elided_reduce(graph, c, bucket, g.reduces, views)
            elif c.kind == Kind.ALL_GATHER:
                handles[c.id] = _issue_all_gather(graph, c, bucket, g.gathers, group, views,
                                                  one_op)
            else:
                handles[c.id] = _issue_reduce_scatter(graph, c, bucket, g.reduces, group, views,
                                                      one_op)
    # (the node before each position's issues, to the position's first issued node)
    first_issued = {pos: prev.next for pos, prev in first_issued.items()}
    for c in sorted(colls, key=lambda c: (c.wait_pos, c.kind == Kind.ALL_REDUCE)):
        if c.elided:  # nothing was issued, nothing to wait for
            continue
        bucket = plan.buckets[c.bucket]
        where = _anchor(g, gm, c.wait_pos)
        if c.kind != Kind.ALL_REDUCE and c.issue_pos < c.wait_pos and c.wait_pos in first_issued:
            where = first_issued[c.wait_pos]
        with graph.inserting_before(where):
            handle, *buffers = handles[c.id]
            if c.kind == Kind.ALL_GATHER:
                _wait_all_gather(graph, c, bucket, g.gathers, handle, views, tuple(buffers),
                                 fusing and one_op)
            elif c.kind == Kind.ALL_REDUCE:
                _wait_all_reduce(graph, c, bucket, g, handle, rank, views, *buffers)
            else:
                reduce = _wait_reduce_scatter(graph, c, bucket, g, handle, rank, views,
                                              tuple(buffers))
                if reduce is not None:  # HSDP: its all-reduce, issued here
                    handles[c.link] = reduce
        # Name the collective of the issue and wait nodes (errors at run time name it).
        for node in (handle, *handle.users):
            node.meta[COLLECTIVE_META] = c.id
    lower_d2h(gm, g, plan.copies, grads_ready_key)  # the reduced shards exist now
    # The collectives found in the graph move last: around shardc's, as their data needs.
    lower_found(gm, g, found)
    by_name = {n.name: n for n in graph.nodes}
    for c in found:
        for name in c.nodes:
            by_name[name].meta[COLLECTIVE_META] = c.id
    _erase_dead_views(graph, shards)
    _skip_identity_views(graph, grad_views)
    graph.lint()
    gm.recompile()
    return gm
