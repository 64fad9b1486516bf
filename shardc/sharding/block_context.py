"""Context-variable writes in a repeated block's forward, found at :func:`shardc.shard` time.

A shared block body (``shardc.sharding.blocks``) is a ``nested_compile_region``: Dynamo must
trace it whole, without a graph break. Dynamo cannot trace ``contextvars.ContextVar.set``: plain
``torch.compile`` breaks the graph there, a body cannot, so a block whose forward sets a context
variable keeps the usual path. (Holders that switch to a plain attribute under compilation, as
the ``kernels`` package's around transformers' attention modules, trace fine and need nothing.)

The check reads the code of each submodule's ``forward`` (following ``functools.wraps``'
``__wrapped__``): a global or closure variable that is a ``ContextVar``, in a function whose code
calls an attribute named ``set``. It does not follow other calls; a write hidden in a helper
function still fails in Dynamo, with Dynamo's message.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from torch import nn

__all__ = ["ContextWrite", "context_writes"]

_MAX_WRAPPED = 8  # functools.wraps chains followed per forward


@dataclass(frozen=True)
class ContextWrite:
    """A context variable that submodule ``module`` of a block sets in its forward."""

    module: str  # the submodule's name in the block ("" for the block itself)
    name: str  # the global or closure variable holding the ContextVar

    def describe(self) -> str:
        where = f" (submodule {self.module!r})" if self.module else ""
        return f"{self.name}{where}"


def context_writes(block: nn.Module) -> list[ContextWrite]:
    """The context variables ``block``'s submodules set in their forwards (see the module
    docstring), in module order."""
    found: list[ContextWrite] = []
    for name, sub in block.named_modules():
        forward = sub.__dict__.get("forward") or type(sub).forward
        seen: set[str] = set()
        for fn in _wrapped_chain(forward):
            for var in _context_vars_set(fn):
                if var not in seen:
                    seen.add(var)
                    found.append(ContextWrite(name, var))
    return found


def _wrapped_chain(fn) -> list:
    chain = []
    for _ in range(_MAX_WRAPPED):
        fn = getattr(fn, "__func__", fn)
        if getattr(fn, "__code__", None) is None:
            break
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return chain


def _context_vars_set(fn) -> list[str]:
    """The names of the ContextVars ``fn`` reads from its globals or closure, if its code calls
    an attribute named ``set``."""
    code = fn.__code__
    if "set" not in code.co_names:
        return []
    values = [(n, fn.__globals__[n]) for n in code.co_names if n in fn.__globals__]
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            values.append((var, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    return [var for var, value in values if isinstance(value, contextvars.ContextVar)]
