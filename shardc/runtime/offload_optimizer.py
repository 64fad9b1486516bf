"""Optimizer-only CPU offload: ``shardc.OffloadPolicy(params=False, optimizer=True)``.

The parameter shards and their gradients stay on the device, so the forward, the backward,
``no_sync`` accumulation and gradient clipping are exactly those of a run without offload; the
optimizer's state and its step live on the host (ZeRO-Offload's split). The user builds the
optimizer over ``model.parameters()`` (the device DTensors) as usual. ``torch.optim`` creates
its state and steps on its parameters' device, so around each step of an optimizer that holds
such parameters shardc's optimizer step hooks (``register_optimizer_step_pre_hook`` /
``..._post_hook``, public torch API, registered once per process) do this:

1. before the step, each parameter's device shard and gradient are copied into host buffers
   kept for it (pinned on CUDA): its *host master*, a DTensor laid out like the parameter
   whose local tensor is the host buffer, with the host gradient as its ``.grad`` (``None``
   where the parameter has none, so the optimizer skips it as it would the parameter);
2. in each parameter group the host masters stand in for the parameters, and each parameter's
   state entry moves to its master (``optimizer.state`` is keyed by parameter object): the
   user's optimizer, unchanged, steps on the host with host state and its own CPU kernels;
3. after the step the parameters and their (updated) state entries are put back, and each
   master is copied into its device shard.

Only the parameters :func:`remember` (or :func:`adopt`) named step on the host: a parameter
group may mix them with parameters that step on the device (the peak budget's partial choice,
``shardc.planning.optimizer_offload``), which keep their place, their state and their device
in it. ``torch.optim`` then steps one group over two devices: its ``foreach`` and ``fused``
implementations group the tensors by device and dtype (``Optimizer.
_group_tensors_by_device_and_dtype``) and run each device's kernels on its own tensors (CPU has
fused AdamW/Adam/SGD kernels); left unset, ``foreach`` defaults to False for a group holding any
CPU tensor (``_default_to_fused_or_foreach``), so the device part then steps with the
per-tensor kernels: pass ``foreach=True`` or ``fused=True`` to keep it on the multi-tensor ones.
Refused at the step, naming the parameter: ``capturable=True`` (it steps on the device) and a
tensor hyperparameter (``lr``) on the device.

Outside ``step()`` the optimizer holds the device parameters, and its state (keyed by them)
is DTensors in global coordinates whose local tensors are host tensors: ``state_dict()``,
``get_state_dict`` / ``set_state_dict`` and DCP see the same keys, shapes and values as
without offload. State loaded onto the device (``load_state_dict`` casts state to its
parameter's device) is moved back to the host at the next step.

The host master is refreshed from the device shard before every step (one device->host copy
of the shard per step), so changes made to the device shards between steps (initialization,
checkpoint loads, in-place edits) are never lost. If ``step()`` raises, the post-hook does not
run: the next ``step()``, ``state_dict()`` or ``load_state_dict()`` puts the parameters back
first (the device shards keep their values from before the failed step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardc._torch import dtensor_on_local_device

__all__ = ["adopt", "remember", "host_master", "steps_on_host"]


@dataclass
class _HostCopy:
    """One parameter's host buffers (allocated at its first step, again if its shard's shape or
    dtype changed)."""

    fqn: str
    pin: bool
    master: nn.Parameter | None = None  # DTensor; its local tensor is ``local``
    local: torch.Tensor | None = None
    grad: DTensor | None = None  # the host gradient DTensor; its local tensor is ``grad_local``
    grad_local: torch.Tensor | None = None


# id(device parameter) -> (weak reference to it, its host copy).
_PARAMS: dict[int, tuple[weakref.ref, _HostCopy]] = {}
_HOOKS: list = []


@dataclass
class _Swap:
    """An optimizer's groups while its step runs on the host masters."""

    saved: list[list]  # per group, its parameter list
    pairs: list[tuple[DTensor, nn.Parameter]]  # (device parameter, host master)


_SWAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Swap | None


def remember(param: DTensor, fqn: str, pin: bool) -> None:
    """Record ``param`` (named ``fqn``) as a parameter whose optimizer steps on the host;
    ``pin``: pin its host buffers."""
    key = id(param)

    def forget(_ref, key=key) -> None:
        _PARAMS.pop(key, None)

    _PARAMS[key] = (weakref.ref(param, forget), _HostCopy(fqn, pin))
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
        _HOOKS.append(register_optimizer_step_post_hook(_post_step))


def adopt(params: list[tuple[str, torch.Tensor]], pin: bool) -> int:
    """Step the optimizer of ``params`` (``(name, parameter)``) on the host from their next
    step on, as :func:`remember` does at ``shardc.shard`` for optimizer-only offload: the peak
    budget's choice (``shardc.planning.optimizer_offload``), made at compile time. Parameters
    already remembered, and any that are not DTensors, are left as they are; state the
    optimizer already holds on the device moves to the host at the next step. Returns how
    many were added."""
    added = 0
    for fqn, param in params:
        if isinstance(param, DTensor) and _host_copy(param) is None:
            remember(param, fqn, pin)
            added += 1
    return added


def _host_copy(param: torch.Tensor) -> _HostCopy | None:
    entry = _PARAMS.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def any_steps_on_host() -> bool:
    """Whether any parameter's optimizer state and step are on the host (remembered or
    adopted, and maybe gone since)."""
    return bool(_PARAMS)


def steps_on_host(param: torch.Tensor) -> bool:
    """Whether ``param``'s optimizer state and step are on the host (remembered or adopted)."""
    return _host_copy(param) is not None


def host_master(param: torch.Tensor) -> nn.Parameter | None:
    """``param``'s host master (None before its first step or if it is not offloaded)."""
    host = _host_copy(param)
    return host.master if host is not None else None


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def _check_group(group: dict, hosted: list[tuple[torch.Tensor, _HostCopy | None]]) -> None:
    """Raise, naming the parameter, where a group cannot step its host-stepped parameters on
    the host. A group may mix them with device-stepped parameters (see the module
    docstring); a tensor hyperparameter on the device is refused, since the host's kernels
    would read it across devices."""
    named = [(p, h) for p, h in hosted if h is not None]
    if not named:
        return
    if group.get("capturable"):
        raise RuntimeError(
            f"shardc: the optimizer's parameter group holding {named[0][1].fqn!r} has "
            "capturable=True, which steps on the device; with OffloadPolicy(params=False, "
            "optimizer=True) the step runs on the host. Build the optimizer without "
            "capturable=True.")
    for p, host in named:
        if not isinstance(p, DTensor):
            raise RuntimeError(
                f"shardc: parameter {host.fqn!r} is no longer the DTensor shardc.shard made; "
                "load values in place instead of replacing parameters.")
        grad = p.grad
        if grad is not None and (not isinstance(grad, DTensor)
                                 or grad.placements != p.placements
                                 or grad.to_local().shape != p.to_local().shape):
            what = (f"a {type(grad).__name__}" if not isinstance(grad, DTensor)
                    else f"a DTensor with placements {grad.placements}")
            raise RuntimeError(
                f"shardc: the gradient of parameter {host.fqn!r} is {what}, not a DTensor "
                f"sharded like its parameter ({p.placements}) as the backward leaves it; its "
                "optimizer steps on the host over the local shards, so assign gradients "
                "sharded like the parameter or let the backward produce them.")
    on_device = [key for key, value in group.items() if key != "params"
                 and isinstance(value, torch.Tensor) and _local_device(value).type != "cpu"]
    if on_device:
        raise RuntimeError(
            f"shardc: the optimizer's parameter group holding {named[0][1].fqn!r} has "
            f"{on_device[0]} as a tensor on {_local_device(group[on_device[0]])}; that "
            "parameter's optimizer steps on the host (OffloadPolicy(params=False, "
            "optimizer=True), or the peak budget's optimizer offload), whose kernels read "
            f"{on_device[0]} there. Pass {on_device[0]} as a float or a CPU tensor.")


def _buffer(like: torch.Tensor, have: torch.Tensor | None, pin: bool) -> torch.Tensor:
    if have is not None and have.shape == like.shape and have.dtype == like.dtype:
        return have
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)


def _stage(param: DTensor, host: _HostCopy) -> nn.Parameter:
    """Copy ``param``'s device shard and gradient into its host master (asynchronous from a
    CUDA device; the caller synchronizes); returns the master."""
    local = param.to_local()
    buf = _buffer(local, host.local, host.pin)
    if buf is not host.local or host.master is None:
        host.local = buf
        host.master = nn.Parameter(
            dtensor_on_local_device(buf, param.device_mesh, param.placements, param.shape,
                                    param.stride()),
            requires_grad=param.requires_grad)
    buf.copy_(local, non_blocking=True)
    grad = param.grad
    if grad is None:
        host.master.grad = None
        return host.master
    g_local = grad.to_local()
    g_buf = _buffer(g_local, host.grad_local, host.pin)
    if g_buf is not host.grad_local or host.grad is None:
        host.grad_local = g_buf
        host.grad = dtensor_on_local_device(g_buf, grad.device_mesh, grad.placements,
                                            grad.shape, grad.stride())
    g_buf.copy_(g_local, non_blocking=True)
    host.master.grad = host.grad
    return host.master


def _on_host(value: object) -> object:
    """A state value in host memory (state loaded through ``load_state_dict`` follows its
    parameter to the device)."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.device.type == "cpu":
            return value
        return dtensor_on_local_device(local.to("cpu"), value.device_mesh, value.placements,
                                       value.shape, value.stride())
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to("cpu")
    return value


def _state_on_host(held: dict) -> dict:
    moved = {k: _on_host(v) for k, v in held.items()}
    if all(moved[k] is v for k, v in held.items()):
        return held  # the same dict object: nothing of its identity changes
    held.clear()
    held.update(moved)
    return held


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _restore(optimizer)  # a step that raised left the host masters installed
    if not _PARAMS:
        return
    hosted_groups = [[(p, _host_copy(p)) for p in g["params"]] for g in optimizer.param_groups]
    if not any(h is not None for hosted in hosted_groups for _, h in hosted):
        return
    for group, hosted in zip(optimizer.param_groups, hosted_groups):
        _check_group(group, hosted)
    if optimizer not in _SWAPS:  # first step: put the parameters back before (de)serializing
        optimizer.register_state_dict_pre_hook(_restore)
        optimizer.register_load_state_dict_pre_hook(_restore_before_load)
    # Recorded before anything moves, so that a failure half-way is undone like a failed step.
    swap = _SWAPS[optimizer] = _Swap([], [])
    state, on_cuda = optimizer.state, False
    with torch.no_grad():
        for group, hosted in zip(optimizer.param_groups, hosted_groups):
            swap.saved.append(group["params"])
            params = []
            for p, host in hosted:
                if host is None:
                    params.append(p)
                    continue
                master = _stage(p, host)
                on_cuda = on_cuda or p.to_local().device.type == "cuda"
                swap.pairs.append((p, master))
                if p in state:  # moved to the host in place first: nothing lost if it fails
                    _state_on_host(state[p])
                    state[master] = state.pop(p)
                params.append(master)
            group["params"] = params
    if on_cuda:  # the host copies must have landed before the CPU reads them
        torch.cuda.current_stream().synchronize()


def _post_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    _restore(optimizer, copy_back=True)


def _restore_before_load(optimizer: torch.optim.Optimizer, state_dict: dict):
    _restore(optimizer)
    return None


def _restore(optimizer: torch.optim.Optimizer, copy_back: bool = False) -> None:
    """Put the device parameters and their state back (a no-op outside a step); ``copy_back``
    (after a step that completed): copy each host master into its device shard."""
    swap = _SWAPS.get(optimizer)
    if swap is None:
        return
    _SWAPS[optimizer] = None
    state = optimizer.state
    with torch.no_grad():
        for group, params in zip(optimizer.param_groups, swap.saved):
            group["params"] = params
        for p, master in swap.pairs:
            stepped = state.pop(master, None)
            if stepped is not None:
                state[p] = stepped
            master.grad = None
            if copy_back:
                # Asynchronous from pinned memory; the next write into the master is the next
                # step's copy from the device, ordered after this one on the same stream.
                p.to_local().copy_(master.to_local(), non_blocking=True)
