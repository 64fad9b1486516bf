"""Optimizer helpers for sharded models (torch.optim optimizers stay torch.optim optimizers)."""

from shardc.optim.default_local_step import set_default_local_step
from shardc.optim.local_step import LocalShardStep, local_shard_step
from shardc.optim.step_in_backward import StepInBackward, step_in_backward

__all__ = ["LocalShardStep", "StepInBackward", "local_shard_step", "set_default_local_step",
           "step_in_backward"]
