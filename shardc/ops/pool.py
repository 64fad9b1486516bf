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


@torch.library.custom_op("shardc::pool_pack", mutates_args=("out",))
def pool_pack(out: torch.Tensor, tensors: list[torch.Tensor], rows: list[int], world: int,
              rank_major: bool, divisor: int = 1) -> None:
    """Pack ``tensors`` into ``out`` (a view of the pool), each cast to ``out``'s dtype,
    divided by ``divisor`` (a reduce-scatter's pre-averaging) and zero-padded to its ``rows``
    entry (rows per rank).

    ``rank_major=False`` (an all-gather's send buffer, 1-D): the padded tensors one after the
    other. ``rank_major=True`` (a reduce-scatter's send buffer, ``(world, n)``): tensor ``t``
    padded to ``rows * world`` rows fills columns ``[off, off + rows * row_numel)``, rank ``w``'s
    rows in row ``w``.
    """
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


def _unpack_shapes(sizes: list[int], ndims: list[int]) -> list[list[int]]:
    shapes, at = [], 0
    for nd in ndims:
        shapes.append(sizes[at:at + nd])
        at += nd
    return shapes


@torch.library.custom_op("shardc::pool_unpack", mutates_args=())
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


@pool_unpack.register_fake
def _pool_unpack_fake(buffer, world, offsets, rows, sizes, ndims):
    return [buffer.new_empty(shape) for shape in _unpack_shapes(sizes, ndims)]


@torch.library.custom_op("shardc::unpack_into", mutates_args=("outs",))
def unpack_into(buffer: torch.Tensor, world: int, offsets: list[int],
                outs: list[torch.Tensor]) -> None:
    """Copy a gathered bucket out of ``buffer`` (rank-major, ``(world, n)`` flattened) into
    ``outs``, buffers the graph allocated: ``outs[i]``, ``world * k`` elements, gets columns
    ``[offsets[i], offsets[i] + k)`` of every rank, rank after rank. One op per bucket where
    the pool-less lowering made a copy (``clone``) per parameter; the graph still allocates
    each output itself (``empty``), so a compiler allocates and reuses them as it did the
    copies (``shardc.passes.lower._unpack_before``)."""
    table = buffer.view(world, -1)
    for off, out in zip(offsets, outs):
        cols = out.numel() // world
        out.view(world, cols).copy_(table[:, off:off + cols])


POOL_PACK_OP = torch.ops.shardc.pool_pack.default
POOL_UNPACK_OP = torch.ops.shardc.pool_unpack.default
UNPACK_INTO_OP = torch.ops.shardc.unpack_into.default
_EMPTY = torch.ops.aten.empty.memory_format


def is_unpacked_into(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a buffer (an ``empty``) that a ``shardc::unpack_into`` of its graph
    fills: a gathered parameter's copy (``shardc.passes.lower._unpack_before``)."""
    return node.op == "call_function" and node.target is _EMPTY and any(
        u.target is UNPACK_INTO_OP and node in u.args[3] for u in node.users)
