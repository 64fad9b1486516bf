"""The optimizer steps the local shards by default, where that is exact.

``shardc.optim.local_shard_step`` makes ``optimizer.step()`` run torch.optim's kernels over the
local shards of its DTensor parameters instead of through DTensor's dispatch: bitwise the same
parameters and state, without DTensor's per-parameter work. That work is largest in an
optimizer's first step, where DTensor computes the sharding of each foreach op over every
parameter (cached afterwards): on torch 2.11 it grows linearly with the parameter tensors (one
H200, the 1b benchmark at 64 layers, 579 tensors: 2.2 s, 0.26 s stepping the local shards);
from torch 2.12 DTensor re-reads the whole argument list for each tensor of a foreach op, so it
grows with their square (this project's CPU, 579 tensors: 1.3 s on torch 2.11, 5.3-5.6 s on
2.12-2.14, 0.06-0.36 s stepping the local shards; docs/bench/optimizer_first_step/).

So shardc applies the local step itself, to the optimizers of the parameters ``shardc.shard``
made, for each step where it is exact and changes nothing another hook could see. torch's
public process-wide step hooks (``register_optimizer_step_pre_hook`` / ``..._post_hook``,
registered once, at the first ``shardc.shard``) swap the groups' parameters for their local
shards before the step and put everything back after it (:class:`LocalShardStep`'s swap, without
hooks of its own on the optimizer). A step goes through DTensor as before (decided per step, no
state carried between the two: both leave DTensor state) where:

- the optimizer's class is not exactly one of ``ELEMENTWISE`` (a subclass's step may compute
  across a whole parameter, e.g. a trust ratio from its norm);
- ``step(closure)`` (the closure recomputes gradients after the swap read them);
- another hook runs around the step (the optimizer's own or process-wide, not shardc's): it
  would see the local shards in the groups;
- ``optimizer.step`` is being compiled;
- a parameter of the optimizer is a DTensor that ``shardc.shard`` did not make (or made
  CPU-offloaded, or FP8-quantized by TransformerEngine), or a gradient is laid out otherwise
  than its parameter (a partial sum would be stepped unreduced);
- another shardc change holds the step: ``shardc.optim.local_shard_step`` applied by the user,
  ``shardc.step_in_backward``, or the plan's optimizer step in chunks.

:func:`set_default_local_step` turns it off for the process or for one optimizer (then every
step goes through DTensor, as torch.optim does by itself).
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from shardc._torch import dtensor_spec_fast as _spec_of
from shardc.optim.local_step import ELEMENTWISE, LocalShardStep
from shardc.runtime import chunked_step, offload_optimizer

log = logging.getLogger("shardc")

__all__ = ["install", "set_default_local_step"]

_HOOKS: list = []
_ENABLED = [True]
# Where the parameters shardc.shard made are found (by id): shardc.sharding.shard's registry of
# live models, handed over by install() (this module is below the sharding package).
_SOURCE: list[Callable[[], dict[int, torch.Tensor]]] = []
# Likewise the parameters forwards read as plain leaves (plain_inputs), with their names.
_PLAIN_SOURCE: list[Callable[[], dict[int, str]]] = []
_NO_GRAD_SAID: weakref.WeakSet = weakref.WeakSet()  # the optimizers already warned
# Per optimizer, the parameters it was checked for. (Its swap is an attribute of the optimizer,
# _SWAP_ATTR: the swap holds the optimizer, which a value of a WeakKeyDictionary keyed by it
# would keep alive, with its state and parameters, for ever.)
_SWAP_ATTR = "_shardc_default_local_step"
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SAID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the reason last logged
_OWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per-optimizer settings


def set_default_local_step(enabled: bool,
                           optimizer: torch.optim.Optimizer | None = None) -> None:
    """Turn shardc's default local-shard optimizer step on or off for this process (on by
    default), or with ``optimizer`` for that optimizer only (its setting wins over the
    process's). ``shardc.optim.local_shard_step(optimizer)`` applies the local step to one
    optimizer whatever this says."""
    if optimizer is None:
        _ENABLED[0] = bool(enabled)
    else:
        _OWN[optimizer] = bool(enabled)


def install(steppable_params: Callable[[], dict[int, torch.Tensor]],
            plain_params: Callable[[], dict[int, str]] | None = None) -> None:
    """Register the process-wide step hooks (once; ``shardc.shard`` calls this with where the
    parameters whose local shards may step are found, by id, and those read as plain leaves)."""
    if not _SOURCE:
        _SOURCE.append(steppable_params)
    if plain_params is not None and not _PLAIN_SOURCE:
        _PLAIN_SOURCE.append(plain_params)
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
        _HOOKS.append(register_optimizer_step_post_hook(_post_step))


def _params(optimizer: torch.optim.Optimizer) -> list:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _params_reason(optimizer: torch.optim.Optimizer) -> str:
    """Why the optimizer's parameters keep the DTensor step ("" where they need not); the
    answer is kept while the optimizer holds the same parameter objects. (By identity, not
    weak references: packed blocks swap their parameters' contents, which a weak reference
    forbids.)"""
    params = _params(optimizer)
    checked = _CHECKED.get(optimizer)
    if checked is not None and len(checked[0]) == len(params) and all(
            map(operator.is_, checked[0], params)):
        return checked[1]
    ours = _SOURCE[0]()
    reason = ""
    dtensors = [p for p in params if isinstance(p, DTensor)]
    if not dtensors:
        reason = "it holds no DTensor parameter"
    elif any(ours.get(id(p)) is not p for p in dtensors):
        reason = ("it holds DTensor parameters that shardc.shard did not make, or made "
                  "CPU-offloaded or FP8-quantized by TransformerEngine")
    _CHECKED[optimizer] = (params, reason)
    return reason


def _offload_reason(optimizer: torch.optim.Optimizer) -> str:
    """Checked at every step: the peak budget may offload the optimizer of parameters that
    stepped on the device before (decided when a region compiles)."""
    if offload_optimizer.any_steps_on_host() and any(
            offload_optimizer.steps_on_host(p) for p in _params(optimizer)):
        return "some of its parameters step on the host (optimizer offload)"
    return ""


def _grads_reason(optimizer: torch.optim.Optimizer) -> str:
    for g in optimizer.param_groups:
        for p in g["params"]:
            grad = p.grad
            if grad is None or not isinstance(p, DTensor):
                continue
            if type(grad) is DTensor and _spec_of(grad) is _spec_of(p):
                continue  # the parameter's own spec: shardc's hand-offs
            if (not isinstance(grad, DTensor) or grad.placements != p.placements
                    or grad.device_mesh != p.device_mesh):
                return "a gradient is not laid out as its parameter"
    return ""


def _closure(args: tuple, kwargs: dict):
    """The closure a step hook's ``(args, kwargs)`` pass to ``step`` (``args[0]`` is the
    optimizer), or None."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _step_reason(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str:
    """Why this step keeps the DTensor step ("" where the local shards step)."""
    if type(optimizer) not in ELEMENTWISE:
        return (f"{type(optimizer).__name__} is not exactly one of the optimizers known to "
                "update each parameter elementwise")
    if _closure(args, kwargs) is not None:
        return "optimizer.step(closure)"
    foreign = chunked_step.foreign_hooks(optimizer)
    if foreign:
        return f"its step hooks {', '.join(foreign)} would see the local shards"
    if getattr(optimizer, "_shardc_step_in_backward", None) is not None:
        return "shardc.step_in_backward steps it"
    if chunked_step.steps_in_chunks(optimizer):
        return "the plan steps it in chunks"
    return (_params_reason(optimizer) or _offload_reason(optimizer)
            or _grads_reason(optimizer))


def _say_if_no_gradient_reached(optimizer: torch.optim.Optimizer) -> None:
    """Warn (once per optimizer) where a step finds no gradient on any of its parameters and
    forwards read some of them as plain leaves: ``torch.autograd.grad`` /
    ``backward(inputs=params)`` with respect to those parameters do not reach them (they are
    not in the autograd graph), and ``backward(inputs=params)`` says nothing itself. Cheap
    where any parameter has a gradient (the first one found ends it)."""
    if not _PLAIN_SOURCE or optimizer in _NO_GRAD_SAID or any(
            p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    plain = _PLAIN_SOURCE[0]()
    names = [plain[id(p)] for p in _params(optimizer) if id(p) in plain and p.requires_grad]
    if not names:
        return
    _NO_GRAD_SAID.add(optimizer)
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    log.warning(
        "shardc: %s.step() found no gradient on any of its parameters, and shardc's forwards "
        "read %d of them (%s) as plain local shards (shardc.shard's plain_inputs=True, the "
        "default), which are not in the autograd graph: torch.autograd.grad(...) or "
        "backward(inputs=...) with respect to these parameters does not reach them. Call "
        "backward() and read .grad, or shard with plain_inputs=False.",
        type(optimizer).__name__, len(names), shown)


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    swap = optimizer.__dict__.get(_SWAP_ATTR)
    if swap is not None:
        swap._restore(optimizer)  # a step that raised left its swap installed
    if torch.compiler.is_compiling():
        return
    # A closure computes the gradients inside the step (LBFGS), after this hook.
    if _closure(args, kwargs) is None:
        _say_if_no_gradient_reached(optimizer)
    if (not _OWN.get(optimizer, _ENABLED[0])
            or getattr(optimizer, "_shardc_local_step", None) is not None):
        return
    reason = _step_reason(optimizer, args, kwargs)
    if _SAID.get(optimizer) != reason:
        _SAID[optimizer] = reason
        if reason:
            log.info("shardc: this %s steps through DTensor: %s", type(optimizer).__name__,
                     reason)
        else:
            log.info("shardc: this %s steps the local shards of shardc's parameters "
                     "(shardc.optim.set_default_local_step(False) turns it off)",
                     type(optimizer).__name__)
    if reason:
        return
    if swap is None:
        swap = optimizer.__dict__[_SWAP_ATTR] = LocalShardStep(optimizer, step_hooks=False)
    swap._pre(optimizer, args, kwargs)


def _post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    swap = optimizer.__dict__.get(_SWAP_ATTR)
    if swap is not None:
        swap._restore(optimizer)
