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

if TYPE_CHECKING:
    from shardc.sharding.shard import ShardState


class _ForwardDepth(threading.local):
    depth = 0


_FORWARD = _ForwardDepth()


def gathering() -> bool:
    # Compiled regions only ever trace forwards; eager forwards are bracketed by hooks.
    return torch.compiler.is_compiling() or _FORWARD.depth > 0


def enter_forward(module, args) -> None:
    if not torch.compiler.is_compiling():
        _FORWARD.depth += 1


def exit_forward(module, args, output) -> None:
    if not torch.compiler.is_compiling():
        _FORWARD.depth -= 1


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
