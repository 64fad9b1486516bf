"""shardc: a torch.compile backend for compiler-planned fully-sharded data-parallel training."""

from shardc import optim
from shardc.backend import backend, shardc_backend  # the entry point module, then its names
from shardc.compile.options import ShardcOptions
from shardc.optim.step_in_backward import step_in_backward
from shardc.planning.plan import Plan
from shardc.runtime.comm_errors import CollectiveError
from shardc.runtime.plan_check import PlanMismatchError
from shardc.sharding.fp8 import Float8Policy
from shardc.sharding.offload import OffloadPolicy
from shardc.sharding.shard import (
    MixedPrecisionPolicy,
    is_sharded,
    no_sync,
    set_requires_gradient_sync,
    shard,
    shard_state,
)
from shardc.sharding.te import te_autocast, te_float8_policy, te_fp8_recipe
from shardc.tools.explain import explain, explain_all

__version__ = "0.1.0"

__all__ = [
    "CollectiveError",
    "Float8Policy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "Plan",
    "PlanMismatchError",
    "ShardcOptions",
    "backend",
    "explain",
    "explain_all",
    "is_sharded",
    "no_sync",
    "optim",
    "set_requires_gradient_sync",
    "shard",
    "shard_state",
    "shardc_backend",
    "step_in_backward",
    "te_autocast",
    "te_float8_policy",
    "te_fp8_recipe",
]
