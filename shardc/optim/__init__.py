"""Optimizer helpers for sharded models (torch.optim optimizers stay torch.optim optimizers)."""

from shardc.optim.local_step import LocalShardStep, local_shard_step

__all__ = ["LocalShardStep", "local_shard_step"]
