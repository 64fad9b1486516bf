"""Detect optimizers that hold the parameters ``shardc.shard`` replaced.

``shardc.shard`` installs new (DTensor) parameter objects. An optimizer built before it holds the
old ones, which no forward reads and no backward reaches: it would step nothing and the model
would not train, silently. :func:`remember` keeps a weak reference to every replaced parameter
with its name; an optimizer step pre-hook (``register_optimizer_step_pre_hook``, public torch
API, registered once per process) raises before such an optimizer steps, naming the parameters.
Nothing keeps a replaced parameter alive: once no optimizer (or user code) holds it, it is gone
from the registry too.
"""

from __future__ import annotations

import torch

from shardc.runtime.param_names import WeakParamNames


def remember(param: torch.Tensor, fqn: str) -> None:
    """Record ``param`` (named ``fqn``) as replaced by ``shardc.shard``."""
    _REPLACED.remember(param, fqn)


def replaced_name(param: torch.Tensor) -> str | None:
    """The name of ``param`` if ``shardc.shard`` replaced it (and it is still alive)."""
    return _REPLACED.name(param)


def stale_params(optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the replaced parameters ``optimizer`` holds, in its order."""
    if not _REPLACED:
        return []
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = replaced_name(p)
            if name is not None:
                names.append(name)
    return names


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    stale = stale_params(optimizer)
    if not stale:
        return
    shown = ", ".join(repr(n) for n in stale[:8]) + (", ..." if len(stale) > 8 else "")
    raise RuntimeError(
        f"shardc: this {type(optimizer).__name__} holds {len(stale)} parameter(s) that "
        f"shardc.shard replaced ({shown}): it was built before shardc.shard, so it would update "
        "tensors the model no longer uses and the model would not train. Build the optimizer "
        "after shardc.shard(model), from model.parameters()."
    )


# The replaced parameters and their names in the sharded model.
_REPLACED = WeakParamNames(_check_optimizer)
