"""Ops that compiled code calls at every step, defined at the dispatcher's level.

``torch.library.custom_op`` wraps an op's kernel in Python layers (autograd, the version
counters of mutated arguments, argument checks) that cost about 35 us a call on a 2-core CPU,
and over 100 us with inputs that require gradients: on a GPU the bulk of a bucket copy's host
time, where the copy itself is one kernel launch (docs/design.md, thirty-eighth session). The
ops here have no gradient (compiled code calls them after AOTAutograd, on values it already
differentiated), so they are defined with a schema (``torch.library.define``) and one kernel
for every backend (``CompositeExplicitAutograd``), and the dispatcher calls that Python
function directly; the fake kernel tells compilers the output metadata. Public
``torch.library`` APIs only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardc import _torch


def define_runtime_op(name: str, schema: str, kernel: Callable,
                      fake: Callable | None = None) -> _torch.OpOverload:
    """Define ``shardc::<name>`` with ``schema`` (its arguments and returns, e.g.
    ``"(Tensor[] tensors, Tensor(a!)[] outs) -> ()"``: mutated arguments annotated), run by
    ``kernel`` on every device, and by ``fake`` under fake tensors (default: nothing, for ops
    that only write into their arguments). Returns the op's overload."""
    qualname = f"shardc::{name}"
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "CompositeExplicitAutograd")(kernel)
    torch.library.register_fake(qualname)(fake if fake is not None else _writes_only)
    return getattr(torch.ops.shardc, name).default


def _writes_only(*args, **kwargs) -> None:
    return None
