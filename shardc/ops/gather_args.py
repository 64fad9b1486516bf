"""The arguments of shardc's gather and reduce ops, by name.

A sharded parameter is read through ``shardc::gather_param`` (:mod:`shardc.ops.gather`), whose
arguments describe it (name, rows, group, dtypes, gradient-sync mode, HSDP replicas); its
gradient goes through ``shardc::reduce_scatter_grad``. In a traced graph both are nodes whose
arguments are positional. :class:`GatherArgs` and :class:`ReduceArgs` are the one place that
knows the positions: everything that writes the ops' arguments (the sharded parameter's read,
the FP8 and TransformerEngine gathers, the autograd backward) encodes them with :meth:`args`,
and every pass that reads a node decodes it with :meth:`of`. The field order is the ops' schema
order, which :func:`check_schema` verifies when the ops are defined, so an argument added to
one but not the other fails at import instead of shifting every reader.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

import torch
from torch import fx

from shardc import _torch
from shardc.runtime.grad_sync import REDUCE


def _decode(cls, node_or_args):
    """Field values from an FX node (positional arguments, then keyword ones, then the
    defaults) or from a positional tuple."""
    if isinstance(node_or_args, fx.Node):
        args, kwargs = node_or_args.args, node_or_args.kwargs
    else:
        args, kwargs = tuple(node_or_args), {}
    values = {}
    for i, f in enumerate(fields(cls)):
        if i < len(args):
            values[f.name] = args[i]
        elif f.name in kwargs:
            values[f.name] = kwargs[f.name]
        elif f.default is MISSING:
            raise TypeError(f"shardc: {cls.__name__} lacks the argument {f.name!r}")
    return cls(**values)


@dataclass(frozen=True)
class GatherArgs:
    """``gather_param``'s arguments: the sent shard (a tensor, or its node in a graph) and the
    constants that describe the parameter."""

    shard: Any
    fqn: str
    dim0: int  # global rows
    world: int  # ranks of the shard group
    group_name: str
    compute_dtype: torch.dtype | None  # the gathered dtype (None: the shard's)
    reduce_dtype: torch.dtype | None  # the gradient's reduce-scatter dtype (None: the shard's)
    reshard_after_forward: bool
    grad_sync: int = REDUCE
    sync_key: str = ""  # names the model's gradient store (shardc.runtime.grad_sync)
    replicate: int = 1  # HSDP: replicas the gradient is also averaged over
    replicate_group: str = ""

    @classmethod
    def of(cls, node_or_args) -> GatherArgs:
        return _decode(cls, node_or_args)

    def args(self) -> tuple:
        """The op's positional arguments."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def constants(self) -> tuple:
        """The op's positional arguments after the shard (its first): what a read of the
        parameter passes after the tensor, for building once outside a traced forward."""
        return self.args()[1:]

    def reduce_args(self, grad: Any, out_dtype: torch.dtype) -> ReduceArgs:
        """The reduction of this parameter's gradient ``grad`` into a shard of ``out_dtype``."""
        return ReduceArgs(grad, self.fqn, self.dim0, self.world, self.group_name,
                          self.reduce_dtype, out_dtype, self.replicate, self.replicate_group)


@dataclass(frozen=True)
class ReduceArgs:
    """``reduce_scatter_grad``'s arguments: the full gradient and the parameter's constants."""

    grad: Any
    fqn: str
    dim0: int
    world: int
    group_name: str
    reduce_dtype: torch.dtype | None
    out_dtype: torch.dtype  # the shard's dtype
    replicate: int = 1
    replicate_group: str = ""

    @classmethod
    def of(cls, node_or_args) -> ReduceArgs:
        return _decode(cls, node_or_args)

    def args(self) -> tuple:
        """The op's positional arguments; HSDP's pair only when there are replicas, as the
        traced graphs have always held them."""
        values = [getattr(self, f.name) for f in fields(self)]
        return tuple(values if self.replicate > 1 else values[:-2])

    def with_grad(self, grad: Any) -> ReduceArgs:
        return replace(self, grad=grad)


def check_schema(op: _torch.OpOverload, codec: type) -> None:
    """Raise unless ``op``'s arguments are ``codec``'s fields, in order."""
    names = [a.name for a in op._schema.arguments]
    expected = [f.name for f in fields(codec)]
    if names != expected:
        raise RuntimeError(f"shardc: {op} takes {names}, but {codec.__name__} encodes {expected}")


if fields(GatherArgs)[0].name != "shard":  # GatherArgs.constants drops the first argument
    raise RuntimeError("shardc: GatherArgs must start with the shard")
