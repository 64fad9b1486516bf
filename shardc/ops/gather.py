"""shardc's custom ops: "gather this parameter shard", whose autograd reduce-scatters the grad.

A sharded module reads each parameter through :func:`gather_param`. Eagerly the ops run the
collectives at once; under ``torch.compile`` they appear in the joint graph as opaque nodes that the
passes in :mod:`shardc.passes` find and replace with planned (bucketed, prefetched) collectives.
Every argument that describes the parameter (its name, global rows, group, dtypes) is a constant in
the graph, so passes never need to look outside it; :mod:`shardc.ops.gather_args` names them.
"""

from __future__ import annotations

from dataclasses import fields

import torch
import torch.distributed as dist

from shardc.ops.gather_args import GatherArgs, ReduceArgs, check_schema
from shardc.runtime.collectives import (
    all_gather_rows,
    all_reduce_mean,
    reduce_scatter_rows,
    resolve_group,
    shard_rows,
)
from shardc.runtime.grad_sync import REDUCE_STASHED, STASH, stash_grad, take_stashed_grad

_LIB = "shardc"


@torch.library.custom_op(f"{_LIB}::gather_param", mutates_args=())
def gather_param(
    shard: torch.Tensor,
    fqn: str,
    dim0: int,
    world: int,
    group_name: str,
    compute_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: bool,
    grad_sync: int = 0,
    sync_key: str = "",
    replicate: int = 1,
    replicate_group: str = "",
) -> torch.Tensor:
    """The full parameter ``fqn`` (``dim0`` rows) gathered from every rank's dim-0 shard.

    The shard is cast to ``compute_dtype`` before communication. Its gradient is the
    ``reduce_dtype`` average over ranks of the full gradient, scattered back to this rank's rows
    (``grad_sync``: see :mod:`shardc.runtime.grad_sync`; ``sync_key`` names the model's store).
    HSDP: ``replicate > 1`` also averages the gradient over the ``replicate_group`` replicas.
    """
    send = shard if compute_dtype is None else shard.to(compute_dtype)
    return all_gather_rows(send, dim0, world, group_name)


@gather_param.register_fake
def _gather_param_fake(shard, fqn, dim0, world, group_name, compute_dtype, reduce_dtype, reshard,
                       grad_sync=0, sync_key="", replicate=1, replicate_group=""):
    return shard.new_empty((dim0, *shard.shape[1:]), dtype=compute_dtype or shard.dtype)


@torch.library.custom_op(f"{_LIB}::reduce_scatter_grad", mutates_args=())
def reduce_scatter_grad(
    grad: torch.Tensor,
    fqn: str,
    dim0: int,
    world: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    replicate: int = 1,
    replicate_group: str = "",
) -> torch.Tensor:
    """This rank's shard of the average over ranks of the full gradient ``grad`` of ``fqn``
    (HSDP, ``replicate > 1``: then averaged over the ``replicate_group`` replicas too)."""
    send = grad if reduce_dtype is None else grad.to(reduce_dtype)
    rank = dist.get_rank(resolve_group(group_name)) if world > 1 else 0
    local = reduce_scatter_rows(send, dim0, world, group_name, rank)
    if world > 1:
        local = local / world
    if replicate > 1:
        local = all_reduce_mean(local, replicate, replicate_group)
    return local.to(out_dtype)


@reduce_scatter_grad.register_fake
def _reduce_scatter_grad_fake(grad, fqn, dim0, world, group_name, reduce_dtype, out_dtype,
                              replicate=1, replicate_group=""):
    rank = dist.get_rank(resolve_group(group_name)) if world > 1 else 0
    return grad.new_empty((shard_rows(dim0, world, rank), *grad.shape[1:]), dtype=out_dtype)


def _gather_setup_context(ctx, inputs, output) -> None:
    a = GatherArgs.of(inputs)
    ctx.reduce_args = a.reduce_args(None, a.shard.dtype)
    ctx.grad_sync, ctx.sync_key = a.grad_sync, a.sync_key
    ctx.save_for_backward(a.shard if ctx.grad_sync == STASH else None)


def shard_grad(grad: torch.Tensor, reduce_args: ReduceArgs, grad_sync: int, sync_key: str,
               shard_like: torch.Tensor | None) -> torch.Tensor:
    """The shard's gradient from the full gradient ``grad`` of a gathered parameter, in the
    gradient-sync mode ``grad_sync`` (see :mod:`shardc.runtime.grad_sync`): stashed (a zero
    gradient shaped like ``shard_like``, needed only then), or reduce-scattered as
    ``reduce_args`` say (their ``grad`` is ignored), after adding what was stashed."""
    fqn = reduce_args.fqn
    if grad_sync == STASH:
        return stash_grad(grad, sync_key, fqn, shard_like)
    if grad_sync == REDUCE_STASHED:
        grad = take_stashed_grad(grad, sync_key, fqn)
    return reduce_scatter_grad(*reduce_args.with_grad(grad).args())


def _gather_backward(ctx, grad):
    (shard,) = ctx.saved_tensors
    local = shard_grad(grad, ctx.reduce_args, ctx.grad_sync, ctx.sync_key, shard)
    return (local,) + (None,) * (len(ctx.needs_input_grad) - 1)


gather_param.register_autograd(_gather_backward, setup_context=_gather_setup_context)

GATHER_OP = torch.ops.shardc.gather_param.default
REDUCE_SCATTER_OP = torch.ops.shardc.reduce_scatter_grad.default
check_schema(GATHER_OP, GatherArgs)
check_schema(REDUCE_SCATTER_OP, ReduceArgs)
_CODECS = {GATHER_OP: GatherArgs, REDUCE_SCATTER_OP: ReduceArgs}


def shardc_args(node) -> GatherArgs | ReduceArgs | None:
    """The decoded arguments of a gather or reduce node, or None for any other node."""
    codec = _CODECS.get(node.target) if node.op == "call_function" else None
    return None if codec is None else codec.of(node)


def args_with_fqn(node, fqn: str) -> tuple:
    """``node``'s positional arguments (a gather or reduce node) naming parameter ``fqn``."""
    position = [f.name for f in fields(_CODECS[node.target])].index("fqn")
    return (*node.args[:position], fqn, *node.args[position + 1:])
