"""``shardc::pool_pack`` / ``shardc::pool_unpack``: copy values into and out of the communication
pool, opaquely.

A compiler that sees a plain ``clone`` of a pool view may fuse the read into a later kernel, which
can run after the plan has given those pool bytes to the next collective. Inductor also cannot see
that two dtype views of the pool alias. Reading through an opaque op pins the copy to its place in
the graph: after the collective's wait and before the bytes are reused. Writes likewise: a
compiler could otherwise fuse the cast-and-copy of a gradient into the kernel that produces it,
writing the pool before the plan's issue position, while the bytes still belong to another buffer.
"""

from __future__ import annotations

import torch
import torch.fx

from shardc import _torch
from shardc.ops.runtime_op import define_runtime_op


def pool_pack(out: torch.Tensor, tensors: list[torch.Tensor], rows: list[int], world: int,
              rank_major: bool, divisor: int = 1) -> None:
    """Pack ``tensors`` into ``out`` (a view of the pool), each cast to ``out``'s dtype,
    divided by ``divisor`` (a reduce-scatter's pre-averaging) and zero-padded to its ``rows``
    entry (rows per rank).

    ``rank_major=False`` (an all-gather's send buffer, 1-D): the padded tensors one after the
    other. ``rank_major=True`` (a reduce-scatter's send buffer, ``(world, n)``): tensor ``t``
    padded to ``rows * world`` rows fills columns ``[off, off + rows * row_numel)``, rank ``w``'s
    rows in row ``w``.

    Where every tensor's rows per rank are its rows split evenly over the ranks (padding only
    the last) and the tensors share a dtype, the whole buffer is one ``torch._chunk_cat``: one
    kernel on a GPU, where a copy per tensor cost a launch and Python dispatch each.
    """
    chunks = world if rank_major else 1
    if _chunk_cat_packs(out, tensors, rows, chunks):
        _torch.chunk_cat(tensors, 0, chunks, out=out.view(chunks, -1))
        if divisor != 1:
            out.div_(divisor)
        return
    offset = 0
    for t, r in zip(tensors, rows):
        rest = tuple(t.shape[1:])
        row_numel = 1
        for d in rest:
            row_numel *= d
        n = r * row_numel
        # Padding is zeroed only where there is some (runs every step, once per tensor).
        if rank_major:
            dst = out[:, offset:offset + n].view(world, r, *rest)
            if t.shape[0] == r * world:
                dst.copy_(t.unflatten(0, (world, r)))  # a view for any strides: no temporary
            else:
                for w in range(world):
                    have = max(0, min(r, t.shape[0] - w * r))
                    dst[w, :have].copy_(t[w * r:w * r + have])
                    if have < r:
                        dst[w, have:].zero_()
        else:
            dst = out[offset:offset + n].view(r, *rest)
            if t.shape[0] == r:
                dst.copy_(t)
            else:
                dst[:t.shape[0]].copy_(t)
                dst[t.shape[0]:].zero_()
        offset += n
    if divisor != 1:
        out.div_(divisor)


def _chunk_cat_packs(out: torch.Tensor, tensors: list[torch.Tensor], rows: list[int],
                     chunks: int) -> bool:
    """Whether ``torch._chunk_cat(tensors, 0, chunks)`` writes exactly :func:`pool_pack`'s
    layout into ``out``: it pads each tensor's rows to a multiple of ``chunks`` and puts chunk
    ``w`` of every tensor in row ``w``, so each tensor's ``rows`` entry must be its rows divided
    by ``chunks``, rounded up (with one chunk: no padding at all), and together they must fill
    ``out`` (contiguous). Its inputs must share a dtype and have rows."""
    if not tensors or not out.is_contiguous():
        return False
    numel = 0
    for t, r in zip(tensors, rows):
        if t.dim() == 0 or t.shape[0] == 0 or t.dtype != tensors[0].dtype \
                or -(-t.shape[0] // chunks) != r or (chunks == 1 and t.shape[0] != r):
            return False
        numel += r * chunks * (t.numel() // t.shape[0])
    return numel == out.numel()


def _unpack_shapes(sizes: list[int], ndims: list[int]) -> list[list[int]]:
    shapes, at = [], 0
    for nd in ndims:
        shapes.append(sizes[at:at + nd])
        at += nd
    return shapes


def pool_unpack(buffer: torch.Tensor, world: int, offsets: list[int], rows: list[int],
                sizes: list[int], ndims: list[int]) -> list[torch.Tensor]:
    """New contiguous tensors copied out of a flat bucket ``buffer`` (a view of the pool): one
    op per bucket instead of a read and its views per parameter, so the graphs that compilers
    lower hold one node per bucket and one ``getitem`` per parameter.

    ``buffer`` is rank-major, ``(world, n)`` flattened (an all-gather's receive buffer;
    ``world=1`` for a reduced shard): tensor ``i`` (shape ``sizes`` split by ``ndims``, its
    first size the rows it keeps) is the first ``shape[0]`` rows of the concatenation over
    ranks of columns ``[offsets[i], offsets[i] + rows[i] * row_numel)``, each rank's block
    ``rows[i]`` rows of ``shape[1:]``: what slicing, copying, viewing and slicing again gave.
    """
    table = buffer.view(world, -1)
    out = []
    for off, r, shape in zip(offsets, rows, _unpack_shapes(sizes, ndims)):
        rest = shape[1:]
        row_numel = 1
        for d in rest:
            row_numel *= d
        dst = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
        keep = shape[0]
        full = min(keep // r, world) if r else 0  # ranks whose rows are all kept
        if full:
            rows_full = dst if full * r == shape[0] else dst[:full * r]
            rows_full.view(full, r * row_numel).copy_(table[:full, off:off + r * row_numel])
        left = keep - full * r  # the rows kept of the next rank (padding dropped)
        if left:
            dst[full * r:].view(-1).copy_(table[full, off:off + left * row_numel])
        out.append(dst)
    return out


def _pool_unpack_fake(buffer, world, offsets, rows, sizes, ndims):
    return [buffer.new_empty(shape) for shape in _unpack_shapes(sizes, ndims)]


def unpack_into(buffer: torch.Tensor, world: int, offsets: list[int],
                outs: list[torch.Tensor]) -> None:
    """Copy a gathered bucket out of ``buffer`` (rank-major, ``(world, n)`` flattened) into
    ``outs``, buffers the graph allocated: ``outs[i]``, ``world * k`` elements, gets columns
    ``[offsets[i], offsets[i] + k)`` of every rank, rank after rank. One op per bucket where
    the pool-less lowering made a copy (``clone``) per parameter; the graph still allocates
    each output itself (``empty``), so a compiler allocates and reuses them as it did the
    copies (``shardc.passes.lower._unpack_before``). Where the outputs take the buffer's
    columns in order, from the first to the last, it is one ``torch.split_with_sizes_copy``
    (one kernel on a GPU)."""
    table = buffer.view(world, -1)
    cols = [out.numel() // world for out in outs]
    if offsets == [sum(cols[:i]) for i in range(len(cols))] and sum(cols) == table.shape[1] \
            and all(out.is_contiguous() for out in outs):
        torch.split_with_sizes_copy(table, cols, dim=1,
                                    out=[out.view(world, c) for out, c in zip(outs, cols)])
        return
    for off, out, k in zip(offsets, outs, cols):
        out.view(world, k).copy_(table[:, off:off + k])


def cast_into(tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Copy each of ``tensors`` into the buffer of its shape in ``outs``, cast to that buffer's
    dtype: a one-rank group's gathered weights (the shards cast to the compute dtype) or
    reduced gradients (cast to the reduce dtype), one op per bucket where the lowering made a
    cast per parameter (``shardc.passes.lower.elide``). One foreach copy: a few launches for
    the bucket on a GPU, where the casts were a kernel each."""
    _torch.foreach_copy_(outs, tensors)


POOL_PACK_OP = define_runtime_op(
    "pool_pack", "(Tensor(a!) out, Tensor[] tensors, int[] rows, int world, bool rank_major, "
    "int divisor=1) -> ()", pool_pack)
POOL_UNPACK_OP = define_runtime_op(
    "pool_unpack", "(Tensor buffer, int world, int[] offsets, int[] rows, int[] sizes, "
    "int[] ndims) -> Tensor[]", pool_unpack, _pool_unpack_fake)
UNPACK_INTO_OP = define_runtime_op(
    "unpack_into", "(Tensor buffer, int world, int[] offsets, Tensor(a!)[] outs) -> ()",
    unpack_into)
CAST_INTO_OP = define_runtime_op(
    "cast_into", "(Tensor[] tensors, Tensor(a!)[] outs) -> ()", cast_into)
_EMPTY = torch.ops.aten.empty.memory_format
# The ops that fill buffers the graph allocated (``empty``), by the position of that list.
_FILLED_ARG = {UNPACK_INTO_OP: 3, CAST_INTO_OP: 1}


def filled_buffers(node: torch.fx.Node) -> tuple:
    """The buffers ``node`` fills if it is a ``shardc::unpack_into`` or ``shardc::cast_into``
    (their ``outs``), else ``()``."""
    at = _FILLED_ARG.get(node.target) if node.op == "call_function" else None
    return tuple(node.args[at]) if at is not None else ()


def is_filled_copy(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a buffer (an ``empty``) that a ``shardc::unpack_into`` or
    ``shardc::cast_into`` of its graph fills: a gathered parameter's copy or a one-rank
    group's cast (``shardc.passes.lower._unpack_before``, ``_cast_bucket``), each standing for
    the per-parameter copy or cast it replaces."""
    return node.op == "call_function" and node.target is _EMPTY and any(
        node in filled_buffers(u) for u in node.users)
