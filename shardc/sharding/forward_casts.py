"""The forward casts of a :class:`~shardc.sharding.shard.MixedPrecisionPolicy`:
``cast_forward_inputs`` (floating-point inputs to ``param_dtype``) and ``output_dtype``
(floating-point outputs to it).

Why: with ``param_dtype=torch.bfloat16`` the gathered parameters are bf16, and a float32 input
meets them in the first matrix product ("mat1 and mat2 must have the same dtype"). FSDP2 casts
each ``fully_shard`` module's floating inputs to ``param_dtype`` (and its floating outputs to
``output_dtype`` where set) in its forward hooks; ``shardc.shard`` is applied once, to the root,
so shardc casts at the root only: the root's floating inputs before its forward, its floating
outputs after it. A submodule called on its own (not through the root) gets no cast.

How: two hooks on the root, through the public ``nn.Module`` hook API (no patching): a forward
pre-hook with ``with_kwargs=True`` registered before shardc's own hooks (so it runs before
shardc's forward count, ``enter_forward``), and a forward hook appended after shardc's
``exit_forward``. Neither is prepended: torch 2.11's Dynamo names a module's hooks for its guards
by their position in ``dict.keys`` of the hook dict, which is the insertion order, not the order
a prepend moves a hook to, so a prepended hook made the guards of any compiled function that
takes the module as an argument (``torch.compile(functools.partial(loss_fn, model))``) fail to
build (``TypeError: 'NoneType' object is not subscriptable``, s67). So a pre-hook the user
registered on the root before ``shard`` runs before the cast and sees the inputs uncast (FSDP2,
which prepends, runs the cast first).
Dynamo inlines both into the graph of a compiled root (a cast node per floating input or
output), and eager calls, activation checkpointing's recomputation included, run them as plain
Python. Each hook is traced into every compiled graph and run at every eager call, so
:func:`register` adds one only where it has work to do: the input cast where ``param_dtype`` is
set and ``cast_forward_inputs`` is on, the output cast where ``output_dtype`` is set; the graphs
of a policy without them are unchanged.

What is cast, as FSDP2's ``_cast_fp_tensor``: every tensor (DTensors too, whose ``.to`` keeps
their placements) whose dtype is floating point and differs from the target; integer, boolean
and complex tensors (token ids, masks) and non-tensors pass as they are. Nested arguments are
walked with ``torch.utils._pytree`` (tuples, lists, dicts, namedtuples, ``OrderedDict`` and the
types registered with it, e.g. transformers' ``ModelOutput``; a ``torch.Size`` is a leaf, which
pytree would rebuild as a plain tuple). A dataclass instance that pytree does not know is
entered as FSDP2's walk enters it: a copy (``dataclasses.replace``) with its ``init`` fields
walked in turn; ``replace`` runs the class's ``__init__`` (and ``__post_init__``) again, so a
field with ``init=False`` gets the value they give it, as with FSDP2.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from shardc import _torch


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` (any pytree of arguments or outputs) with every floating-point tensor whose dtype
    is not ``dtype`` cast to it, the rest as it is (in containers rebuilt by pytree)."""
    # Both functions nested: Dynamo guards the code of each module-level function it inlines,
    # at every call of every compiled region (the input cast adds 7 guards to a region: the
    # two-layer bf16 llama's step, 435 -> 442; a tree_flatten / tree_unflatten walk added 32 more).
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
        # (the class attribute ``dataclasses.is_dataclass`` reads, without that function:
        # Dynamo guards each module-level function it inlines, 11 guards more a region with two
        # non-tensor arguments, s67)
        if not isinstance(x, type) and hasattr(type(x), "__dataclass_fields__"):
            return _cast_dataclass(x, dtype)
        return x

    # pytree walks a torch.Size as a node and rebuilds it as a plain tuple: a leaf here.
    return _torch.tree_map(cast, tree, is_leaf=lambda x: isinstance(x, torch.Size))


def _cast_dataclass(obj: Any, dtype: torch.dtype) -> Any:
    """A copy of the dataclass instance ``obj`` with its ``init`` fields cast as
    :func:`cast_floating` casts (only traced where a dataclass is among the arguments)."""
    changes = {f.name: cast_floating(getattr(obj, f.name), dtype)
               for f in dataclasses.fields(obj) if f.init}
    return dataclasses.replace(obj, **changes)


def _inputs_hook(dtype: torch.dtype):
    def cast_forward_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cast_floating(args, dtype), cast_floating(kwargs, dtype)

    return cast_forward_inputs


def _outputs_hook(dtype: torch.dtype):
    def cast_forward_outputs(module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_floating(output, dtype)

    return cast_forward_outputs


def register_input_cast(root: nn.Module, param_dtype: torch.dtype | None,
                        cast_forward_inputs: bool) -> None:
    """Register on ``root`` the input cast the policy asks for (none: nothing is registered).
    Called by ``shardc.shard`` before it registers its own forward hooks on ``root``."""
    if param_dtype is not None and cast_forward_inputs:
        root.register_forward_pre_hook(_inputs_hook(param_dtype), with_kwargs=True)


def register_output_cast(root: nn.Module, output_dtype: torch.dtype | None) -> None:
    """Register on ``root`` the output cast the policy asks for (none: nothing is registered).
    Called by ``shardc.shard`` after its own forward hooks are on ``root``."""
    if output_dtype is not None:
        root.register_forward_hook(_outputs_hook(output_dtype))
