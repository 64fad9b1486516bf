"""When a sharded parameter's read gathers it: inside a forward of a sharded module.

:func:`shardc.sharding.shard.shard` swaps each owning module's class for one whose parameter
properties gather inside a forward (:func:`gathering`) and return the shard outside one; forward
hooks count the forwards running eagerly. The FP8 linear's forward asks the same question.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardc._torch import run_frame_eagerly

if TYPE_CHECKING:
    from shardc.sharding.shard import ShardState


class _ForwardDepth(threading.local):
    """The forwards running eagerly on this thread: ``depth`` of them, ``open`` per module
    (``id``). An exit hook closes only a forward its module's enter hook opened, so a count
    never leaks and never closes another module's forward."""

    def __init__(self) -> None:
        self.depth = 0
        self.open: dict[int, int] = {}


_FORWARD = _ForwardDepth()


def gathering() -> bool:
    # Compiled regions only ever trace forwards; eager forwards are bracketed by hooks.
    return torch.compiler.is_compiling() or _FORWARD.depth > 0


def enter_forward(module, args) -> None:
    names = getattr(type(module), "_shardc_param_names", None)
    if names is not None:
        _check_no_new_params(module, names)
    if not torch.compiler.is_compiling():
        key = id(module)
        _FORWARD.open[key] = _FORWARD.open.get(key, 0) + 1
        _FORWARD.depth += 1


def _check_no_new_params(module: nn.Module, names: tuple[str, ...]) -> None:
    """A parameter registered on a sharded module after ``shardc.shard`` would be trained by
    each rank on its own gradient, unsynchronized: refuse it."""
    new = [n for n, p in module._parameters.items() if p is not None and n not in names]
    if new:
        raise RuntimeError(
            f"shardc: parameter(s) {new} of a sharded {type(module).__name__} were registered "
            "after shardc.shard; shardc does not shard or synchronize them, so each rank would "
            "train its own copy. Register every parameter before shardc.shard (or register a "
            "buffer if it is not trained)."
        )


def exit_forward(module, args, output) -> None:
    # Registered with ``always_call=True``: runs when the forward (or a later hook) raises.
    if torch.compiler.is_compiling():
        return
    key = id(module)
    opened = _FORWARD.open.get(key, 0)
    if opened:  # else its enter hook was traced into a graph (a no-op there): nothing to close
        if opened == 1:
            del _FORWARD.open[key]
        else:
            _FORWARD.open[key] = opened - 1
        _FORWARD.depth -= 1


# Why the count is exact: Dynamo inlines these hooks into the graph it traces from a module call
# (``is_compiling()``: no count, no cost at run time), or the module call runs as plain Python
# and so do both hooks. What it must never do is compile one of them as a frame of its own
# (after a graph break in a module call, or once a hook's frame hit the recompile limit): the
# compiled frame would skip the count that its partner, run eagerly, makes. So their frames always
# run as plain Python.
run_frame_eagerly(enter_forward)
run_frame_eagerly(exit_forward)


def in_eager_forward() -> bool:
    """Whether a caller is the forward of a sharded module, running eagerly although no forward
    hook counted it: Dynamo's eager fallback (after its recompile limit) runs a forward whose
    hooks it had compiled, and compiled code skips the count. Only parameter reads outside
    ``gathering()`` pay for this walk."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_name
        if name == "forward" or name.startswith("torch_dynamo_resume_in_forward"):
            owner = frame.f_locals.get("self")
            if is_sharded(owner) or shard_state(owner) is not None:
                return True
        frame = frame.f_back
    return False


class ShardedModuleMixin:
    """Marks a module whose parameters were sharded by :func:`shard` (a mixin, not a module)."""

    _shardc_param_names: tuple[str, ...] = ()


def is_sharded(module: nn.Module) -> bool:
    return isinstance(module, ShardedModuleMixin)


def shard_state(module: nn.Module) -> ShardState | None:
    """The :class:`~shardc.sharding.shard.ShardState` recorded by ``shardc.shard`` on
    ``module``, if any."""
    return getattr(module, "_shardc_state", None)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The user's module behind ``torch.compile(model)`` (its ``OptimizedModule`` wrapper), or
    ``model`` itself."""
    return getattr(model, "_orig_mod", model)
