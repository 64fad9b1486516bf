"""The collectives the checkpoint protocol needs, over one process group.

Contract: every method is collective (call it on every rank, in the same order) and returns the
same answer on every rank where it says so. Without ``torch.distributed`` (or in a world of one)
each degrades to the single-process answer and communicates nothing, so the manager runs the
same code alone and distributed. :meth:`RankGroup.raise_if_any` and
:meth:`RankGroup.raise_from_rank0` turn one rank's error into the same exception on every rank:
no rank goes on into a collective that another rank left.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from shardc.checkpoint.errors import CheckpointError

__all__ = ["RankGroup"]


class RankGroup:
    """``pg`` (``None``: the default group) as this rank sees it."""

    def __init__(self, pg: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pg = pg
        self.rank = dist.get_rank(pg) if self.distributed else 0
        self.world = dist.get_world_size(pg) if self.distributed else 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed or self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere); waits for every rank's part."""
        if not self.distributed or self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, group=self.pg, group_dst=0)
        return out

    def raise_if_any(self, error: str | None, exc_type: type[Exception] = CheckpointError) -> None:
        """Raise on every rank if any rank has an error (the same message everywhere)."""
        errors = self.all_gather(error)
        found = [(r, e) for r, e in enumerate(errors) if e]
        if not found:
            return
        if len({e for _, e in found}) == 1 and len(found) == self.world:
            raise exc_type(found[0][1])
        raise exc_type("\n".join(f"[rank {r}] {e}" for r, e in found))

    def raise_from_rank0(self, error: str | None, exc_type: type[Exception] = CheckpointError):
        """Raise rank 0's error (if it has one) on every rank; other ranks' ``error`` is unused."""
        error = self.broadcast(error)
        if error:
            raise exc_type(error)
