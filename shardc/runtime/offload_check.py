"""Check, before an optimizer steps, that what it holds fits CPU offload.

With ``shardc.shard(..., offload=...)`` the optimizer steps on the CPU on the DTensor
parameters whose local shards live in host memory. Before each step of an optimizer holding
such parameters (an optimizer step pre-hook, public torch API, registered once per process when
a model is first offloaded) every offloaded parameter is checked to be the sharded DTensor
shardc installed, with a host local shard, and so is its gradient; a parameter group mixing
offloaded parameters with parameters on the device is refused, naming one of each (torch's
fused and foreach kernels would fail with a device mismatch that names neither). An optimizer
built before ``shardc.shard`` is named by :mod:`shardc.runtime.replaced_params`. State an
optimizer holds on the device for such a parameter (made before the peak budget moved it,
``OffloadPolicy(params="auto")``) moves to the host at that check.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from shardc.runtime.param_names import WeakParamNames


def _check_optimizer(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _OFFLOADED:
        return
    for group in optimizer.param_groups:
        check_group(group["params"])
        _state_to_host(optimizer, group["params"])


def _state_to_host(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Move the state the optimizer holds on the device for an offloaded parameter to the host:
    state made before the peak budget moved the parameter's shard there
    (``OffloadPolicy(params="auto")``, an optimizer that stepped before the region compiled).
    Nothing is dropped: each tensor is copied, the same values."""
    for p in params:
        state = optimizer.state.get(p) if offloaded_name(p) is not None else None
        for key, value in (state or {}).items():
            if isinstance(value, torch.Tensor) and _local_device(value).type != "cpu":
                state[key] = _to_host(value)


def _to_host(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        from shardc._torch import dtensor_on_local_device

        return dtensor_on_local_device(value.to_local().to("cpu"), value.device_mesh,
                                       value.placements, value.shape, value.stride())
    return value.to("cpu")


_OFFLOADED = WeakParamNames(_check_optimizer)  # the offloaded parameters and their names


def remember(param: torch.Tensor, fqn: str) -> None:
    """Record ``param`` (named ``fqn``) as an offloaded shardc parameter."""
    _OFFLOADED.remember(param, fqn)


def offloaded_name(param: torch.Tensor) -> str | None:
    return _OFFLOADED.name(param)


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def check_group(params: list[torch.Tensor]) -> None:
    """Raise if a parameter group does not fit offload (see the module docstring)."""
    offloaded = [(p, offloaded_name(p)) for p in params]
    named = [(p, n) for p, n in offloaded if n is not None]
    if not named:
        return
    for p, name in named:
        if not isinstance(p, DTensor) or _local_device(p).type != "cpu":
            raise RuntimeError(
                f"shardc: offloaded parameter {name!r} is no longer a DTensor with a host "
                f"shard (it is on {_local_device(p)}); load values in place instead of "
                "replacing or moving offloaded parameters.")
        grad = p.grad
        if grad is not None and (not isinstance(grad, DTensor) or
                                 _local_device(grad).type != "cpu"):
            raise RuntimeError(
                f"shardc: the gradient of offloaded parameter {name!r} is a "
                f"{type(grad).__name__} on {_local_device(grad)}, not a DTensor with a host "
                "shard as the backward leaves it; the optimizer steps on the host, so assign "
                "gradients like the parameter (a host DTensor) or let the backward produce them.")
    other = next(((p, i) for i, (p, n) in enumerate(offloaded)
                  if n is None and _local_device(p).type != "cpu"), None)
    if other is not None:
        raise RuntimeError(
            f"shardc: one optimizer parameter group holds offloaded parameters (e.g. "
            f"{named[0][1]!r}, on the host) and parameter #{other[1]} on "
            f"{_local_device(other[0])}; torch.optim steps a group on one device. Put the "
            "offloaded parameters in their own optimizer (or parameter group) or offload all.")
