"""Process-group plumbing and the eager collectives behind shardc's custom ops.

Everything here works on plain (local) tensors. Row arithmetic follows ``torch.chunk``, which is
how DTensor ``Shard(0)`` splits a dimension: every rank holds ``ceil(dim0 / world)`` rows except the
last non-empty one, and trailing ranks may hold none. Collectives exchange shards padded to the
common row count, so the bytes a collective moves never depend on the rank.

The private torch APIs shardc needs for groups (resolving a group from its name, which is how
graphs and custom ops refer to groups; a group's store and timeout, for the plan check) come
from :mod:`shardc._torch`, through the functions here.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from shardc import _torch

# Functional collectives: the ops compiled graphs use; they run eagerly too, on NCCL and gloo.
_funcol = _torch.funcol


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (as used in graphs and custom ops)."""
    return _torch.resolve_process_group(group_name)


def group_name_of(group: dist.ProcessGroup) -> str:
    return group.group_name


def group_ranks(group_name: str) -> tuple[int, ...]:
    """The global ranks of the process group registered under ``group_name``."""
    return tuple(dist.get_process_group_ranks(resolve_group(group_name)))


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The key-value store of ``group`` (its own key prefix), shared by its ranks."""
    return _torch.process_group_store(group)


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group``'s collectives wait for (the store's timeout if it cannot be read)."""
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
    try:
        return _torch.process_group_timeout(group, device)
    except (AttributeError, RuntimeError):
        return group_store(group).timeout


def padded_rows(dim0: int, world: int) -> int:
    """Rows every rank contributes to a collective: the largest shard (``torch.chunk`` size)."""
    return -(-dim0 // world) if dim0 > 0 else 0


def shard_rows(dim0: int, world: int, rank: int) -> int:
    """Rows of ``rank``'s shard of a dimension of size ``dim0`` split like ``torch.chunk``."""
    chunk = padded_rows(dim0, world)
    return max(0, min(chunk, dim0 - rank * chunk))


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (no copy if already that size)."""
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def all_gather_rows(
    shard: torch.Tensor, dim0: int, world: int, group_name: str
) -> torch.Tensor:
    """Eager all-gather of a dim-0 shard into the full ``dim0``-row tensor (a new tensor)."""
    rows = padded_rows(dim0, world)
    send = pad_rows(shard, rows).contiguous()
    if world == 1:
        return send.clone().narrow(0, 0, dim0)
    out = _funcol.all_gather_into_tensor(as_comm_bytes(send), world, group_name)
    return _funcol.wait_tensor(out).view(send.dtype).narrow(0, 0, dim0)


def is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def as_comm_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a float8 tensor its ``uint8`` view (same bytes): gloo and some
    NCCL builds have no float8 collectives, and an all-gather only moves bytes."""
    return t.view(torch.uint8) if is_float8(t.dtype) else t


def reduce_scatter_rows(
    full: torch.Tensor, dim0: int, world: int, group_name: str, rank: int
) -> torch.Tensor:
    """Eager sum reduce-scatter of a full ``dim0``-row tensor into this rank's shard."""
    rows = padded_rows(dim0, world)
    send = pad_rows(full, rows * world).contiguous()
    if world == 1:
        out = send.clone()
    else:
        out = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(send, "sum", world, group_name))
    return out.narrow(0, 0, shard_rows(dim0, world, rank))


def all_reduce_mean(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Eager average of ``t`` over the ``world`` ranks of ``group_name`` (HSDP's replicas)."""
    out = _funcol.wait_tensor(_funcol.all_reduce(t.contiguous(), "sum", group_name))
    return out / world
