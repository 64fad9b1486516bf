"""A single-process stand-in for a world of N ranks, for planning without GPUs.

torch ships a "fake" process-group backend (in its testing package) that accepts every collective
without communicating (``shardc._torch.fake_store``). shardc uses it only to plan, here.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from shardc import _torch


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """Initialize the default process group as rank ``rank`` of a fake ``world_size`` world."""
    if dist.is_initialized():
        raise RuntimeError(
            "shardc: a process group is already initialized; plan in a fresh process"
        )
    dist.init_process_group("fake", store=_torch.fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
